"""Convert an HF PEFT LoRA adapter to TensorRT-LLM's files (model.lora_weights.npy, model.lora_config.npy).

    python scripts/hf_lora_convert.py -i PEFT_DIR -o OUT_DIR [--storage-type float16|bfloat16|float32]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from backend.lora.peft import STORAGE_TYPES, peft_to_trtllm, save_trtllm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-i", "--in-file", "--input", dest="input", required=True, type=Path)
    parser.add_argument("-o", "--out-dir", "--output", dest="output", required=True, type=Path)
    parser.add_argument("--storage-type", choices=list(STORAGE_TYPES), default="float16")
    args = parser.parse_args()
    weights, config = peft_to_trtllm(args.input, args.storage_type)
    save_trtllm(args.output, weights, config)
    print(f"wrote {len(config)} rows ({weights.shape[1]} values each, {args.storage_type}) to {args.output}")


if __name__ == "__main__":
    main()
