"""Run by llama-cpp's own Python (scripts/anchors.py convert): a checkpoint to GGUF files, F32 by
llama.cpp's converter, then Q4_0 by its quantizer (each renamed into place when done). The
converter stops on a pre-tokenizer hash it does not know, such as the tiny tokenizer's: for GPT-2's
byte-level regex split, and only then, this script tells it "gpt-2".

    python convert_gguf.py CHECKPOINT LLAMA_CPP_SOURCE OUT_F32 OUT_Q4_0
"""

import ctypes
import json
import sys
from pathlib import Path


def convert_f32(checkpoint: Path, source: Path, out: Path) -> None:
    sys.path.insert(0, str(source))
    import convert_hf_to_gguf
    from conversion.base import TextModel

    known = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            pre = json.loads((checkpoint / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
            if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
                raise
            print("convert_gguf: unknown tokenizer hash, GPT-2's byte-level split: gpt-2")
            return "gpt-2"

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = ["convert_hf_to_gguf.py", str(checkpoint), "--outtype", "f32", "--outfile", str(out)]
    convert_hf_to_gguf.main()


def quantize_q4_0(f32: Path, out: Path) -> None:
    """llama-quantize's Q4_0, with its defaults (the tied embedding / output table in Q6_K)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    status = llama_cpp.llama_model_quantize(bytes(f32), bytes(out), ctypes.byref(params))
    if status != 0:
        raise SystemExit(f"convert_gguf: llama_model_quantize failed with status {status}")


def main() -> int:
    checkpoint, source, out_f32, out_q4 = (Path(a) for a in sys.argv[1:5])
    out_f32.parent.mkdir(parents=True, exist_ok=True)
    for out, make in ((out_f32, lambda tmp: convert_f32(checkpoint, source, tmp)),
                      (out_q4, lambda tmp: quantize_q4_0(out_f32, tmp))):  # fmt: skip
        if out.is_file():
            continue
        tmp = out.with_suffix(".tmp")
        try:
            make(tmp)
            tmp.rename(out)
        finally:
            tmp.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
