"""Convert an HF PEFT LoRA adapter to TensorRT-LLM's files (model.lora_weights.npy, model.lora_config.npy).

    python scripts/hf_lora_convert.py -i PEFT_DIR -o OUT_DIR [--storage-type float16|bfloat16|float32]
        [--base-model DIR]
A DoRA adapter (use_dora) needs --base-model: its magnitudes are normalized against that model's weights
(m / ||W + s·B·A|| per output row, as TensorRT-LLM's normalize_weights.py does) and every row gets the fourth
column, is_dora, as TensorRT-LLM's own converter writes it. So does an adapter on a mixture's experts (its expert
count and widths): their rows are TensorRT-LLM's modules 13-17, every expert's A [experts, r, in] then B
[experts, out, r] in one row.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from backend.lora.dora import checkpoint_weights  # noqa: E402
from backend.lora.peft import STORAGE_TYPES, peft_to_trtllm, save_trtllm  # noqa: E402
from backend.model.checkpoint import ModelConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-i", "--in-file", "--input", dest="input", required=True, type=Path)
    parser.add_argument("-o", "--out-dir", "--output", dest="output", required=True, type=Path)
    parser.add_argument("--storage-type", choices=list(STORAGE_TYPES), default="float16")
    parser.add_argument("--base-model", type=Path,
                        help="the base model's directory (for DoRA adapters, and adapters on a mixture's experts)")
    args = parser.parse_args()
    base_weight = checkpoint_weights(args.base_model) if args.base_model else None
    model = ModelConfig.from_dir(args.base_model) if args.base_model else None
    try:
        weights, config = peft_to_trtllm(args.input, args.storage_type, base_weight, model)
    except ValueError as err:
        sys.exit(f"hf_lora_convert: {err}")
    save_trtllm(args.output, weights, config)
    print(f"wrote {len(config)} rows ({weights.shape[1]} values each, {args.storage_type}, "
          f"{config.shape[1]} config columns) to {args.output}")


if __name__ == "__main__":
    main()
