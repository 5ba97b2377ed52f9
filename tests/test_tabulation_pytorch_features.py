"""scripts/dev/tabulate_trtllm_pytorch_features.py on short inputs written here in the syntax of the files it reads
(the guided-decoder block of py_executor_creator.py, the SpeculativeDecodingMode enum, a CUDA graph runner's replay,
release notes, requirements.txt, xgrammar's tokenizer_info.cc / .h and TensorRT-LLM's guidedDecoder.cpp), and the
committed trtllm_pytorch_features table the PyTorch backend and the guided-decoding checks read."""

from types import SimpleNamespace

import pytest

from pipeline.upstream import facts, releases
from tests.conftest import dev_script

tab = dev_script("tabulate_trtllm_pytorch_features")
UnrecognizedSource = tab.UnrecognizedSource

MODES = """
import os


class SpeculativeDecodingMode(IntEnum):
    ALPHA = auto()
    BETA = auto()
    GAMMA = auto()
    NONE = auto()
    AUTO = auto()

    def is_alpha(self):
        return self == SpeculativeDecodingMode.ALPHA

    def is_gamma(self):
        return self == SpeculativeDecodingMode.GAMMA

    def has_spec_drafter(self):
        return self.is_alpha()

    def has_draft_model(self):
        return False

    def support_guided_decoder(self):
        return self == SpeculativeDecodingMode.NONE or self.has_spec_drafter()

    def support_capturable_guided_decoder(self):
        return self.is_gamma()

    def never_called(self, backend: Type[NotImportedHere]):
        return backend


class Other:
    pass
"""

# a slice of a creator: the surrounding lines are cut mid-way, as a page of the index is
BY_MODE = """        kv = make_kv(
            size)
    with monitor.stage(Stage.GUIDED):
        decoder = None
        if guided_decoding_config is not None:
            if mapping.is_last_pp_rank():
                if spec_config is None or spec_config.spec_dec_mode.support_guided_decoder():
                    decoder = Guided()
                elif spec_config.spec_dec_mode.support_capturable_guided_decoder():
                    ok = engine.attach(Guided())
                    if not ok:
                        raise RuntimeError("attach failed")
                else:
                    raise ValueError(f"no guide for {spec_config.spec_dec_mode.name}")
    sampler = make_sampler(
"""

REFUSE_ALL = """
def create(executor_config, spec_config, mapping):
    guided = None
    if executor_config.guided_decoding_config is not None:
        if spec_config is not None:
            raise NotImplementedError("not with drafts")
        guided = Guided()
    return guided
"""

DRAFTER_ONLY = """
    if guided_decoding_config is not None:
        if spec_config is not None and not has_spec_drafter:
            raise ValueError("drafter needed")
"""


def test_modes_a_guided_decoder_is_created_with_are_run_from_the_enum():
    assert tab.guided_with_speculative(BY_MODE, MODES) == {
        "allowed_modes": ["ALPHA", "GAMMA"],
        "refused_modes": ["BETA"],
        "raises": "ValueError",
    }
    assert tab.guided_with_speculative(DRAFTER_ONLY, MODES)["allowed_modes"] == ["ALPHA"]


def test_a_block_refusing_any_speculative_config_needs_no_modes():
    assert tab.guided_with_speculative(REFUSE_ALL, None) == {
        "allowed_modes": [],
        "refused_modes": "every",
        "raises": "NotImplementedError",
    }
    with pytest.raises(UnrecognizedSource, match="interface.py"):  # a block that asks the mode needs the enum
        tab.guided_with_speculative(BY_MODE, None)


def test_a_guided_block_testing_what_is_not_modelled_is_unrecognized():
    odd = "    if guided_decoding_config is not None:\n        if budget.low():\n            raise ValueError()\n"
    with pytest.raises(UnrecognizedSource, match="not modelled"):
        tab.guided_with_speculative(odd, MODES)
    with pytest.raises(UnrecognizedSource, match="no line matches"):
        tab.guided_with_speculative("x = 1\n", MODES)


RUNNER = """
class Graphs:

    def capture(self, key, inputs):
        self.graphs[key] = record(inputs)

    def replay(self, key, current_inputs):
        assert current_inputs["attn_metadata"] is self.meta[key]
        ids = current_inputs["input_ids"]
        self.ids[: len(ids)].copy_(ids)
        if current_inputs.get("lora_params") is not None:
            self.lora.copy_(current_inputs["lora_params"])
        self.graphs[key].replay()

    def clear(self):
        self.graphs = {}
"""

OLD_RUNNER = """    def run(self, inputs):
        meta = inputs["attn_metadata"]
        assert meta is self.meta, "captured with another"
        self.ids.copy_(inputs["input_ids"])
        self.pos.copy_(inputs["position_ids"])
        self.graph.replay()
"""


def test_the_replay_names_what_it_copies_into_the_graph_and_what_it_only_checks():
    assert tab.graph_replay(RUNNER) == {
        "replay_method": "replay",
        "inputs_refreshed": ["input_ids", "lora_params"],
        "inputs_checked_same": ["attn_metadata"],
        "lora_inputs": ["lora_params"],
        "supported": True,
    }
    old = tab.graph_replay(OLD_RUNNER)  # an aliased input checked with `is` is not refreshed
    assert (old["replay_method"], old["inputs_refreshed"], old["inputs_checked_same"], old["supported"]) == (
        "run",
        ["input_ids", "position_ids"],
        ["attn_metadata"],
        False,
    )


NOTES = """# Notes

## TensorRT-LLM Release 2.1

- The dependent transformers version is updated to 9.9.9.

## TensorRT-LLM Release 2.0

- Made guided decoding work together with speculative decoding.
- The dependent xgrammar version is updated to 0.3.1.

## TensorRT-LLM Release 1.9.0

- The dependent xgrammar version is updated to 0.3.0.
"""


def test_each_release_depends_on_the_last_xgrammar_the_notes_updated_to():
    assert tab.xgrammar_versions(NOTES, ["1.9", "2.0", "2.1"]) == {"1.9": "0.3.0", "2.0": "0.3.1", "2.1": "0.3.1"}
    assert tab.first_noted(NOTES, tab.GUIDED_SPECULATIVE_NOTE) == "2.0"
    with pytest.raises(UnrecognizedSource, match="no xgrammar version"):
        tab.xgrammar_versions(NOTES.split("## TensorRT-LLM Release 2.0")[0], ["2.1"])
    assert tab.requirement_pin("numpy<2\nxgrammar==0.3.1\nllguidance\n") == {"operator": "==", "version": "0.3.1"}
    with pytest.raises(UnrecognizedSource, match="2 times"):
        tab.requirement_pin("xgrammar==0.3.1\nxgrammar>=0.3.0\n")


HEADER = """
namespace grammars {

enum class VocabType : int {
  PLAIN = 0,
  BYTES = 7,
};

}
"""

CC = r"""
class Analyzer {
 public:
  static VocabType DetectVocabType(const picojson::object& hf_tokenizer_obj) {
#define CHECK_AND_WARNING(condition, message) \
  if (!(condition)) {                         \
    return VocabType::PLAIN;                  \
  }
    CHECK_AND_WARNING(hf_tokenizer_obj.count("unpacker"), "no unpacker");
    auto obj = hf_tokenizer_obj.at("unpacker").get<picojson::object>();
    auto type = obj.at("type").get<std::string>();
    if (type == "Chain") {
      CHECK_AND_WARNING(obj.count("links") && obj.at("links").is<picojson::array>(), "no links");
    }
    for (const auto& item : items) {
      if (type == "Bytewise") {
        return VocabType::BYTES;
      }
    }
    return VocabType::PLAIN;
  }

  static bool DetectLead(const picojson::object& hf_tokenizer_obj) {
    if (!hf_tokenizer_obj.count("cleaner")) {
      return false;
    }
    if (type == "Chain") {
      if (!obj.count("cleaners") || !obj.at("cleaners").is<picojson::array>()) {
        return false;
      }
    }
    for (const auto& cleaner : cleaners) {
      if (type == "Lead" && obj.count("text") &&
          obj.at("text").get<std::string>() == "_") {
        return true;
      }
    }
    return false;
  }

  static bool DetectSplit(const picojson::object& hf_tokenizer_obj) {
    if (!hf_tokenizer_obj.count("splitter")) {
      return false;
    }
    auto mode = obj.at("mode").get<std::string>();
    return type == "Splitter" && (mode == "start" || mode == "each");
  }

  static bool DetectAddPrefixSpace(const picojson::object& hf_tokenizer_obj) {
    return DetectLead(hf_tokenizer_obj) || DetectSplit(hf_tokenizer_obj);
  }
};

std::shared_ptr<TokenizerInfo::Impl> TokenizerInfo::Impl::FromVocabAndMetadata(const std::string& metadata) {
  CHECK(obj.count("kind") && obj["kind"].is<int64_t>());
  CHECK(obj.count("stops") && obj["stops"].is<picojson::array>());
  return nullptr;
}

std::string TokenizerInfo::Impl::DetectMetadataFromHF(const std::string& backend_str) {
  metadata_obj["kind"] = picojson::value(1);
  metadata_obj["lead"] = picojson::value(true);
  return "";
}
"""


LINE_NOTES = """## TensorRT-LLM Release 2.1

- The dependent NVIDIA ModelOpt version is updated to 0.40.

## TensorRT-LLM Release 2.0.0

- The dependent TensorRT version is updated to 11.2.0
- The dependent NVIDIA ModelOpt version is updated to 0.39.0
"""


def test_a_requirements_copy_is_placed_on_a_release_line_by_the_versions_the_notes_carry_forward():
    assert tab.noted(LINE_NOTES, tab.RELEASE_LINE["tensorrt"][0]) == {"2.0": "11.2", "2.1": "11.2"}
    copy = "tensorrt~=11.2.0\nnvidia-modelopt[torch]~=0.40.0\nxgrammar==0.3.1\n"
    assert tab.release_line(copy, LINE_NOTES, "2.1") == {"tensorrt": "11.2", "modelopt": "0.40"}
    with pytest.raises(UnrecognizedSource, match=r"pins modelopt \['0.40'\], the notes give 2.0 0.39"):
        tab.release_line(copy, LINE_NOTES, "2.0")  # a copy of the next release's line
    with pytest.raises(UnrecognizedSource, match=r"pins tensorrt \[\]"):
        tab.release_line("nvidia-modelopt~=0.40.0\n", LINE_NOTES, "2.1")


def test_a_release_without_a_copy_lies_between_the_tabulated_versions_around_it():
    tags = {"0.3.0": "", "0.3.2": "", "0.3.10": "", "0.4.0": ""}
    assert tab.xgrammar_between("0.3.2", "0.4.0", tags) == ["0.3.2", "0.3.10", "0.4.0"]
    with pytest.raises(UnrecognizedSource, match="tabulate both tags"):
        tab.xgrammar_between("0.3.1", "0.4.0", tags)
    with pytest.raises(UnrecognizedSource, match="the lower first"):
        tab.xgrammar_between("0.4.0", "0.3.0", tags)


def test_an_xgrammar_that_lacks_what_the_cpp_decoder_calls_is_refused():
    files = SimpleNamespace(read=lambda repo, path, commit: CC if path.endswith(".cc") else HEADER)
    assert tab.xgrammar_facts(files, "0.1.16", [])["metadata_requires"] == ["kind", "stops"]
    with pytest.raises(UnrecognizedSource, match=r"defines no \['DetectMetadataFromHF'\]"):
        tab.xgrammar_facts(files, "0.1.16", ["DetectMetadataFromHF"])  # only the Impl's is defined here


def test_what_xgrammar_reads_of_a_tokenizer_is_read_from_its_cpp():
    assert tab.xgrammar_reads(CC, HEADER) == {
        "vocab_types": {"PLAIN": 0, "BYTES": 7},
        "detect_from_hf": {
            "vocab_type": {
                "field": "unpacker",
                "sequence": {"type": "Chain", "items": "links"},
                "by_type": {"Bytewise": "BYTES"},
                "otherwise": "PLAIN",
            },
            "add_prefix_space": [
                {
                    "field": "cleaner",
                    "sequence": {"type": "Chain", "items": "cleaners"},
                    "type": "Lead",
                    "key": "text",
                    "values": ["_"],
                },
                {"field": "splitter", "type": "Splitter", "key": "mode", "values": ["start", "each"]},
            ],
            "returns": ["kind", "lead"],
        },
        "metadata_requires": ["kind", "stops"],
    }
    with pytest.raises(UnrecognizedSource, match="no VocabType"):
        tab.xgrammar_reads(CC.replace("VocabType::BYTES", "VocabType::WORDS"), HEADER)


def test_how_the_cpp_guided_decoder_hands_a_tokenizer_to_xgrammar():
    cpp = """
        if (auto const& str = guidedDecodingConfig.getTokenizerStr())
        {
            auto const meta = nlohmann::json::parse(xgrammar::TokenizerInfo::DetectMetadataFromHF(*str));
            kind = meta.at("vocab_type").template get<int>();
        }
        auto info = xgrammar::TokenizerInfo(guidedDecodingConfig.getEncodedVocab().value(), kind, 10);
    """
    assert tab.tokenizer_info_consumer(cpp) == {
        "xgrammar_calls": ["DetectMetadataFromHF"],
        "metadata_read": ["vocab_type"],
        "config_read": ["TokenizerStr", "EncodedVocab"],
        "vocab_size": None,
    }


# ---------------------------------------------------------------- the committed table

TABLE = facts("trtllm_pytorch_features")


def test_the_table_covers_the_pytorch_backends_releases_with_an_xgrammar_each():
    assert releases("trtllm_pytorch_features") == ("1.0", "1.1", "1.2")
    for release, block in TABLE["releases"].items():
        assert block["xgrammar"]["version"] in TABLE["xgrammar"], release
        assert all(not f["pinned"] and f["release_commit"] for f in block["source"]["files"]), release
    assert [TABLE["releases"][r]["xgrammar"]["requirement"] for r in ("1.0", "1.1", "1.2")] == [
        "==0.1.21",
        "==0.1.25",
        "==0.1.25",
    ]


def test_guided_decoding_with_ngram_drafts_is_refused_by_1_0_only_and_lora_runs_under_no_releases_graphs():
    guided = {r: TABLE["releases"][r]["guided_with_speculative"] for r in ("1.0", "1.1", "1.2")}
    assert guided["1.0"]["refused_modes"] == "every" and guided["1.0"]["raises"] == "ValueError"
    assert "NGRAM" in guided["1.1"]["allowed_modes"] and "NGRAM" in guided["1.2"]["allowed_modes"]
    assert TABLE["guided_with_speculative_noted_in"] == "1.1"  # the release notes agree with the code read
    for release in ("1.0", "1.1", "1.2"):
        lora = TABLE["releases"][release]["lora_with_cuda_graph"]
        assert not lora["supported"] and "input_ids" in lora["inputs_refreshed"], release


def test_the_cpp_backends_releases_are_tabulated_apart_with_an_xgrammar_each_that_reads_as_the_pytorch_ones():
    """0.19-0.21 (Triton's C++ tensorrtllm backend) have no PyTorch-backend facts: their xgrammar is kept apart.
    0.19 and 0.20 pin 0.1.16, each in a copy placed on its line by the notes' TensorRT and ModelOpt versions; 0.21
    lies between 0.20's and 1.0's. Every xgrammar from 0.1.16 to 0.1.25 reads a tokenizer as 0.1.21 does."""
    cpp = TABLE["cpp_backend_xgrammar"]["releases"]
    assert list(cpp) == ["0.19", "0.20", "0.21"] and not set(cpp) & set(TABLE["releases"])
    assert [cpp[r]["xgrammar"]["version"] for r in cpp] == ["0.1.16", "0.1.16", None]
    assert [cpp[r]["release_line"] for r in ("0.19", "0.20")] == [
        {"tensorrt": "10.9", "modelopt": "0.27"},
        {"tensorrt": "10.10", "modelopt": "0.29"},
    ]
    assert cpp["0.21"]["xgrammar"]["versions"] == ["0.1.16", "0.1.17", "0.1.18", "0.1.19", "0.1.20", "0.1.21"]
    assert all(
        f["release_commit"] == cpp[r]["source"]["release_commit"] for r in cpp for f in cpp[r]["source"]["files"]
    )
    reads = {v: {k: x for k, x in read.items() if k != "source"} for v, read in TABLE["xgrammar"].items()}
    assert list(reads) == ["0.1.16", "0.1.17", "0.1.18", "0.1.19", "0.1.20", "0.1.21", "0.1.25"]
    assert all(read == reads["0.1.21"] for read in reads.values())
    assert "DetectMetadataFromHF" in TABLE["tokenizer_info_consumer"]["xgrammar_calls"]
