"""The deploy section (`trtllm-pipeline deploy`): the Kubernetes objects' names, scaling, storage, ports and
scheduling, each field checked against Kubernetes' naming rules when the config is read."""

from __future__ import annotations

import functools
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator

from pipeline.config.sections import Section, version_as_written
from pipeline.errors import shown
from pipeline.k8s_names import DNS1035_LABEL, DNS1123_LABEL, DNS1123_SUBDOMAIN, LABEL_VALUE, label_key_problem

QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")


def _kept(rule, value):
    """`value` when it keeps a Kubernetes naming rule (None passes), else the rule's problem as a validation error."""
    problem = None if value is None else rule(value)
    if problem:
        raise ValueError(problem)
    return value


LabelKey = Annotated[str, AfterValidator(functools.partial(_kept, label_key_problem))]
LabelValue = Annotated[str, AfterValidator(functools.partial(_kept, LABEL_VALUE.problem))]
# Node labels a pod may require: a node carries a few dozen, and a longer list is no selector but a mistake (one
# million keys took minutes to validate); pydantic counts them before it validates any.
MAX_NODE_SELECTOR = 100


class AutoscalingSection(Section):
    """A HorizontalPodAutoscaler on the requests waiting per replica (the target names the Prometheus series)."""

    min_replicas: int = Field(1, ge=1, description="Fewest replicas the autoscaler keeps.")
    max_replicas: int = Field(ge=1, description="Most replicas the autoscaler starts (required).")
    queued_requests_per_replica: float = Field(
        2.0,
        gt=0,
        description="Average number of requests waiting for a batch slot per replica above which the autoscaler adds "
        "replicas (the series `trtllm-pipeline deploy` names, through the Prometheus adapter's custom metrics API).",
    )


class StorageSection(Section):
    """Where the pods find the built output when it is not in the image: a PersistentVolumeClaim."""

    claim: str | None = Field(
        None, description="PersistentVolumeClaim holding the output directory (default: DEPLOY-NAME-artifacts)."
    )
    create: bool = Field(True, description="Write the claim into the manifests (false: it exists already).")
    size: str = Field("50Gi", description="Requested size of a created claim (a Kubernetes quantity).")
    storage_class: str | None = Field(
        None, description="StorageClass of a created claim (null: the cluster's default)."
    )
    access_mode: Literal["ReadWriteOnce", "ReadWriteMany"] = Field(
        "ReadWriteMany",
        description="ReadWriteMany lets every replica and node mount the one build; ReadWriteOnce suits one pod.",
    )
    models_claim: str | None = Field(
        None,
        description="PersistentVolumeClaim holding the checkpoint at model.path (mounted read-only there); needed "
        "when model.source is hf or gguf and the output is built in the pod.",
    )

    @field_validator("claim", "models_claim", "storage_class")
    @classmethod
    def _a_resource_name(cls, name: str | None) -> str | None:
        """Secrets, claims and storage classes are named by DNS-1123 subdomains."""
        return _kept(DNS1123_SUBDOMAIN.problem, name)

    @field_validator("size")
    @classmethod
    def _a_quantity(cls, size: str) -> str:
        if not QUANTITY.fullmatch(size):
            raise ValueError(f"{shown(size)} is not a Kubernetes quantity, e.g. 50Gi or 500G")
        return size


class PortsSection(Section):
    """Container ports of `trtllm-pipeline serve` (each is the matching `serve --*-port` option)."""

    http: int = Field(8000, ge=1, le=65535, description="HTTP: KServe v2, /generate (trtllm-serve: the OpenAI API).")
    grpc: int = Field(8001, ge=1, le=65535, description="gRPC (Triton-served targets).")
    metrics: int = Field(8002, ge=1, le=65535, description="Prometheus metrics (Triton-served targets).")
    openai: int = Field(9000, ge=1, le=65535, description="The OpenAI gateway (when deploy.openai_gateway is on).")


class Toleration(Section):
    key: LabelKey | None = Field(None, description="Taint key (null with operator Exists: every taint).")
    operator: Literal["Equal", "Exists"] = "Equal"
    value: LabelValue | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class DeploySection(Section):
    """Kubernetes manifests for the built output (`trtllm-pipeline deploy`), validated offline before written."""

    name: str | None = Field(
        None, description="Name of every object (a DNS-1035 label, at most 40 characters); default: the config's."
    )
    namespace: str = Field("default", description="Namespace of every object (a DNS-1123 label).")
    kubernetes_version: str = Field(
        "1.33",
        description="Kubernetes release whose OpenAPI schemas validate the manifests (kubernetes-validate ships "
        "1.25 to 1.37).",
    )
    image: str | None = Field(
        None, description="Container image (default: the target's image of our Dockerfile, as `deploy` prints)."
    )
    artifacts: Literal["image", "volume"] | None = Field(
        None,
        description="image: the output was built into the image (docker build --build-arg CONFIG=build_configs/...); "
        "volume: a Job builds it once onto deploy.storage's claim, and the pods wait for it. Default: the target's "
        "(image for CPU engines; volume for GPU outputs, which are built on the GPU they serve from).",
    )
    replicas: int = Field(1, ge=0, description="Replicas (groups of pods, multi-node) when autoscaling is off.")
    autoscaling: AutoscalingSection | None = Field(None, description="Scale replicas on queued requests.")
    gpus_per_node: int | None = Field(
        None,
        ge=1,
        description="trtllm: GPUs of one node (pod); tp x pp above it spreads each replica over several nodes as a "
        "LeaderWorkerSet. Default: tp x pp (one node).",
    )
    cpus: int | None = Field(
        None, ge=1, description="CPU cores requested per pod (default: 2 for onnxruntime, 4 per GPU for trtllm)."
    )
    node_selector: dict[LabelKey, LabelValue] = Field(
        {},
        max_length=MAX_NODE_SELECTOR,
        description=f"Node labels the pods require (label keys and values, at most {MAX_NODE_SELECTOR}).",
    )
    tolerations: list[Toleration] = Field([], description="Taints the pods tolerate (e.g. nvidia.com/gpu).")
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        "ClusterIP", description="How the Service is exposed."
    )
    ports: PortsSection = Field(default_factory=PortsSection)
    openai_gateway: bool = Field(
        True,
        description="Also serve the OpenAI gateway: in front of tritonserver (one pod), or of trtllm-serve (one pod, "
        "or a multi-node group's leader, beside rank 0).",
    )
    expose_triton_ports: bool = Field(
        False,
        description="With the OpenAI gateway, also put tritonserver's HTTP, gRPC and metrics ports on the Service. "
        "They carry no authentication (the Service's trtllm-pipeline/unauthenticated-ports annotation says what a "
        "client there can do); by default the gateway, behind its key, is the only door.",
    )
    api_key_secret: str | None = Field(
        None,
        description="Secret whose key `api-key` the OpenAI gateway requires as a bearer token; null serves it "
        "without one (inside the cluster only, unless exposed: `deploy` warns).",
    )
    storage: StorageSection = Field(default_factory=StorageSection)

    @field_validator("name")
    @classmethod
    def _a_label(cls, name: str | None) -> str | None:
        if name is not None and (len(name) > 40 or DNS1035_LABEL.problem(name)):
            raise ValueError(
                f"{shown(name)} cannot name the objects: use at most 40 lowercase letters, digits or '-', starting "
                "with a letter (room is left for the suffixes of pods and claims)"
            )
        return name

    @field_validator("namespace")
    @classmethod
    def _a_namespace(cls, name: str) -> str:
        """Namespaces are named by DNS-1123 labels (63 characters, no dots)."""
        return _kept(DNS1123_LABEL.problem, name)

    @field_validator("api_key_secret")
    @classmethod
    def _a_resource_name(cls, name: str | None) -> str | None:
        return StorageSection._a_resource_name(name)

    _version_as_written = field_validator("kubernetes_version", mode="before")(version_as_written)
