"""Every kernel, in every configuration the launchers choose, compiles for sm_80 and sm_90 within shared memory."""
import os
import subprocess
import sys

from tests.helpers import ROOT


def test_every_kernel_configuration_compiles_for_a100_and_h100():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, ROOT / "scripts" / "compile_kernels.py", "--targets", "80,90"],
                         capture_output=True, text=True, env=env, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert " 0 failed" in run.stdout
    assert "sm_80 fp8_dots" not in run.stdout                    # e4m3 dots: sm_89 on
    for label in ("sm_80 attention decode bf16 d128 bs32 g4 splits16",
                  "sm_90 attention prefill fp32 d80 bs16 g4 splits1",
                  "sm_90 attention prefill bf16 d128 bs4 g4 splits16",
                  "sm_90 attention decode bf16 d128 bs16 g8 splits1",
                  "sm_80 attention prefill bf16 d128 bs256 g4 splits1", "sm_90 attention_reduce fp32 d64",
                  "sm_80 rotary_and_cache bf16 d80", "sm_90 add_rms_norm fp32 h8192",
                  "sm_90 lora_shrink bf16 adapters bf16 8b qkv r64 t16",
                  "sm_80 lora_expand fp32 adapters fp16 8b down r64 t512",
                  "sm_90 lora_shrink bf16 adapters bf16 8b gate_up r64 t512",
                  "sm_80 lora_expand bf16 adapters bf16 8b qkv r128 t16",
                  "sm_90 moe_gate_up bf16 qwen3-30b-a3b t64", "sm_80 moe_down fp32 mixtral-8x7b t2048",
                  "sm_90 fp8_dots_gemm bf16 8b gate_up t2048", "sm_90 fp8_dots_blocks_gemm fp16 8b o t16",
                  "sm_80 fp8_gemm bf16 8b o t16", "sm_90 fp8_rows bf16 k4096"):
        assert label in run.stdout


def test_resources_of_the_hot_configurations_show_no_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, ROOT / "scripts" / "compile_kernels.py", "--targets", "80,90",
                          "--resources", "--only", "hot"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("ok ")]
    assert len(rows) >= 20 and all(" 0 B spilled" in row and "warps per SM" in row for row in rows)
    assert any(row.startswith("ok   sm_90 attention decode bf16 d128 bs16 g4 splits1") for row in rows)


def test_occupancy_follows_registers_and_shared_memory(monkeypatch):
    if "TRITON_INTERPRET" in os.environ:      # the script drops it as it loads: keep it for the later tests
        monkeypatch.setenv("TRITON_INTERPRET", os.environ["TRITON_INTERPRET"])
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from compile_kernels import occupancy_warps, runtime_signature
    assert occupancy_warps(168, 39168, 4, 90) == 12          # 5376 registers a warp: 12 warps, 3 blocks of 4
    assert occupancy_warps(32, 0, 4, 90) == 64               # the SM's 64-warp limit
    assert occupancy_warps(32, 100 * 1024, 4, 80) == 4       # one 100 KiB block fits in 164 KiB
    signature, attrs, constants = runtime_signature({"p": "*bf16", "num_seqs": 1, "stride_bt": 32}, {"num_seqs",
                                                                                                    "stride_bt"})
    assert signature == {"p": "*bf16", "num_seqs": "i32", "stride_bt": "i32"} and list(attrs) == [(0,)]
    assert not constants
