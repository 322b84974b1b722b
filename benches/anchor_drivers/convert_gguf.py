"""Run by llama-cpp's own Python (scripts/anchors.py convert): a Hugging Face-style checkpoint to
GGUF files for llama.cpp, F32 by llama.cpp's converter, then Q4_0 by llama.cpp's quantizer.

    python convert_gguf.py CHECKPOINT LLAMA_CPP_SOURCE OUT_F32 OUT_Q4_0

The converter names a BPE tokenizer's pre-tokenizer (its regex split) by hashing how the tokenizer
splits a test string, and stops on a hash it does not know: the course's tiny tokenizer is one.
Its pre-tokenizer is GPT-2's byte-level regex split (tokenizers' ByteLevel with use_regex), which
llama.cpp implements as "gpt-2": for exactly that pre-tokenizer, and only when the hash is unknown,
this script answers "gpt-2". Each file is written under a temporary name and renamed when done.
"""

import ctypes
import json
import sys
from pathlib import Path


def byte_level_gpt2(checkpoint: Path) -> bool:
    """Whether the checkpoint's tokenizer.json splits text exactly as GPT-2 does."""
    pre = json.loads((checkpoint / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


def patch_pre_tokenizer(checkpoint: Path) -> None:
    from conversion.base import TextModel  # llama.cpp's converter, on sys.path

    known = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            if not byte_level_gpt2(checkpoint):
                raise
            print("convert_gguf: unknown tokenizer hash, GPT-2's byte-level split: gpt-2")
            return "gpt-2"

    TextModel.get_vocab_base_pre = get_vocab_base_pre


def convert_f32(checkpoint: Path, source: Path, out: Path) -> None:
    sys.path.insert(0, str(source))
    import convert_hf_to_gguf

    patch_pre_tokenizer(checkpoint)
    sys.argv = ["convert_hf_to_gguf.py", str(checkpoint), "--outtype", "f32", "--outfile", str(out)]
    convert_hf_to_gguf.main()


def quantize_q4_0(f32: Path, out: Path) -> None:
    """llama-quantize's Q4_0, with its defaults (the tied embedding / output table in Q6_K)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    status = llama_cpp.llama_model_quantize(
        str(f32).encode(), str(out).encode(), ctypes.byref(params)
    )
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
