"""Shared fixtures: the package under test (--impl student|ref) and tiny checkpoints."""

import importlib
import os

import mlx.core as mx
import pytest

from tiny_llm_support import load_checkpoint, make_tiny_checkpoint

PACKAGES = {"student": "tiny_llm", "ref": "tiny_llm_ref"}


def pytest_addoption(parser):
    parser.addoption(
        "--impl",
        choices=sorted(PACKAGES),
        default=os.environ.get("TINY_LLM_IMPL", "student"),
        help="which package to test: student (tiny_llm) or ref (tiny_llm_ref)",
    )


def pytest_report_header(config):
    impl = config.getoption("--impl")
    return f"tiny-llm: testing {PACKAGES[impl]} (--impl {impl}) on MLX {mx.__version__}"


@pytest.fixture(scope="session")
def impl(request):
    """The package under test, imported by name."""
    return importlib.import_module(PACKAGES[request.config.getoption("--impl")])


@pytest.fixture(autouse=True)
def _cpu_float32():
    """Tests compare against oracles in float32 on the CPU."""
    mx.set_default_device(mx.cpu)
    yield


def _tiny(tmp_path_factory, name: str, **overrides):
    path = tmp_path_factory.mktemp(name)
    make_tiny_checkpoint(path, **overrides)
    return load_checkpoint(path)


@pytest.fixture(scope="session")
def tiny_gqa_ckpt(tmp_path_factory):
    """Grouped-query attention (4 query heads, 2 KV heads), head_dim 32 != 64 / 4, tied."""
    return _tiny(tmp_path_factory, "tiny-gqa", seed=0)


@pytest.fixture(scope="session")
def tiny_untied_ckpt(tmp_path_factory):
    """Untied output head, 3 layers, every query head with its own KV head."""
    return _tiny(
        tmp_path_factory,
        "tiny-untied",
        seed=1,
        tie_word_embeddings=False,
        num_hidden_layers=3,
        num_key_value_heads=4,
    )


@pytest.fixture(scope="session", params=["tied-gqa", "untied-mha"])
def tiny_ckpt(request, tiny_gqa_ckpt, tiny_untied_ckpt):
    """Both tiny checkpoints, one after the other."""
    return tiny_gqa_ckpt if request.param == "tied-gqa" else tiny_untied_ckpt


@pytest.fixture(scope="module")
def model(impl, tiny_gqa_ckpt):
    """The package's Qwen3Model on the GQA checkpoint (Week 3 tests serve requests with it)."""
    return impl.Qwen3Model(tiny_gqa_ckpt)


@pytest.fixture(scope="module")
def tokenizer(tiny_gqa_ckpt):
    return tiny_gqa_ckpt.tokenizer
