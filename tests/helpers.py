"""Oracles and builders the tests share."""
import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "scripts"))   # after the root: scripts/bench.py is not the bench package
from prepare_model import DEFAULT_OUT as SMOLLM2_DIR, build_smollm2, build_tiny, is_complete  # noqa: E402


# CUDA cases carry the `cuda` marker (scripts/gpu_check.sh runs `-m cuda`) and skip where there is no GPU
CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_MARKS)]
# Triton kernels run on CUDA, and on CPU only in the interpreter (tests/conftest.py sets it where there is no GPU)
INTERPRETER_MARK = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="Triton on CPU needs TRITON_INTERPRET=1 (set where no GPU)")
KERNEL_DEVICES = [pytest.param("cpu", marks=INTERPRETER_MARK), pytest.param("cuda", marks=CUDA_MARKS)]


def cpu_kernels_build() -> bool:
    """The compiled CPU kernels build here (not attempted on a GPU machine, whose runs test the CUDA path)."""
    from kernels import cpu_ext
    return not torch.cuda.is_available() and cpu_ext.available()


# The CPU serving paths: the torch reference and the compiled kernels (kernels/cpu_ops.py)
CPU_BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu_kernels_build(), reason="the compiled CPU kernels do not build here (python -m kernels.cpu_ext)"))]


def needs_cuda(test):
    for mark in CUDA_MARKS:
        test = mark(test)
    return test


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face greedy continuation of one prompt (stops at the model's eos, as our engine with end_id)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


def nested_schema(depth: int) -> str:
    """Objects nested `depth` deep around a string (written out: json.dumps recurses past Python's limit)."""
    head = '{"type": "object", "required": ["a"], "properties": {"a": '
    return head * depth + '{"type": "string"}' + "}}" * depth


def kv_bytes_for_blocks(num_blocks: int, block_size: int, model_config, dtype_bytes: int = 4) -> int:
    c = model_config
    return num_blocks * 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * dtype_bytes


ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_SPECS = [   # ranks 4, 8, 16, 64; different alphas; one rsLoRA; one attention-only; one with patterns
    dict(r=4, lora_alpha=8, target_modules=ALL_MODULES),
    dict(r=8, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    dict(r=16, lora_alpha=16, use_rslora=True, target_modules=ALL_MODULES),
    dict(r=64, lora_alpha=64, target_modules=ALL_MODULES, rank_pattern={"down_proj": 12},
         alpha_pattern={"layers.1.self_attn.q_proj": 20}),
]


def make_peft_adapters(base_dir, out_root: Path, specs=ADAPTER_SPECS, seed: int = 0, scale: float = 1.0) -> list[Path]:
    """Random, non-trivial PEFT LoRA adapters for the model in base_dir, saved as PEFT directories (DoRA ones,
    use_dora=True, with magnitudes away from the norms they start at)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    paths = []
    for i, spec in enumerate(specs):
        torch.manual_seed(seed + i)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(init_lora_weights=False, lora_dropout=0.0, **spec))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name and scale != 1.0:
                    param.mul_(scale)
                if "lora_magnitude_vector" in name:       # DoRA: PEFT starts m at ||W + s·B·A||, a scale of 1
                    param.mul_(0.5 + torch.rand(param.shape))
        path = out_root / f"adapter{i}"
        model.save_pretrained(path)
        paths.append(path)
    return paths


def peft_model_with(base_dir, adapter_dirs: list[Path], dtype=torch.float32):
    """A PEFT model holding every adapter, named a0, a1, ... (use '__base__' for no adapter)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    model = PeftModel.from_pretrained(base, adapter_dirs[0], adapter_name="a0")
    for i, path in enumerate(adapter_dirs[1:], start=1):
        model.load_adapter(path, adapter_name=f"a{i}")
    return model.eval()


def with_projections_rounded(model, dtype: torch.dtype):
    """A PEFT model whose base projections and LM head hold values of dtype (in their own dtype): the model that
    bf16 weights beside fp32 activations serve (backend.device.projection_dtype)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (name.endswith("_proj.base_layer") or name.endswith("lm_head")):
            module.weight.data = module.weight.data.to(dtype).to(module.weight.dtype)
    return model


def with_kv_rounded(model, dtype: torch.dtype):
    """A transformers (or PEFT) model whose attention sees K (after RoPE) and V rounded to dtype, in their own dtype:
    the model a KV cache of dtype beside fp32 activations serves."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, *args, **kwargs):
        rounded = (t.to(dtype).to(t.dtype) for t in (key, value))
        return sdpa_attention_forward(module, query, *rounded, *args, **kwargs)
    name = f"kv_rounded_to_{str(dtype).removeprefix('torch.')}"
    AttentionInterface.register(name, attention)
    model.set_attn_implementation(name)
    return model


@contextlib.contextmanager
def adapter_active(model, adapter: str | None):
    """A PEFT model with one adapter active (None: none), in inference mode."""
    with torch.inference_mode(), (model.disable_adapter() if adapter is None else contextlib.nullcontext()):
        if adapter is not None:
            model.set_adapter(adapter)
        yield model


def peft_greedy_alone(model, prompt: list[int], adapter: str | None, max_new_tokens: int) -> list[int]:
    """PEFT greedy with one adapter active (None: none), for adapters PEFT will not mix in a batch (DoRA)."""
    ids = torch.tensor([prompt], device=model.device)
    with adapter_active(model, adapter):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def peft_greedy(model, prompt: list[int], adapter: str, max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0, adapter_names=[adapter])
    return out[0, len(prompt):].tolist()


def num_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settled_num_threads(expected: int, timeout_s: float = 5.0) -> int:
    """The process's thread count once it reaches `expected` (exiting workers take a moment), or after timeout_s."""
    import time
    deadline = time.monotonic() + timeout_s
    while num_threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return num_threads()
