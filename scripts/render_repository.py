"""The model repository for a deployment, with TensorRT-LLM's deployment choices: decoupled or not
(`decoupled_mode`, as its fill_template.py names it) and the core model's name (`tensorrt_llm_model_name`,
the name its BLS model calls; `tensorrt_llm` makes clients that hard-code that name work).

    python scripts/render_repository.py --out DIR [--decoupled_mode false] [--tensorrt_llm_model_name tensorrt_llm]

The defaults are model_repository/ as committed. Otherwise the configs are rendered into DIR and each model's
code is a link to the committed one (so that it still finds the repository root).
"""
import argparse
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "model_repository"
CORE = "lora_llm"
DECOUPLED = ("lora_llm", "ensemble", "tensorrt_llm_bls")     # the streaming models


def render(out: Path, decoupled: bool = True, core_name: str = CORE) -> Path:
    """Write the repository into `out` (emptied first) and return it."""
    if not re.fullmatch(r"[A-Za-z0-9_\-]+", core_name):
        raise ValueError(f"tensorrt_llm_model_name: {core_name!r} is not a model name")
    if out.exists():
        shutil.rmtree(out)
    for model in sorted(p for p in SOURCE.iterdir() if (p / "config.pbtxt").exists()):
        name = core_name if model.name == CORE else model.name
        (out / name / "1").mkdir(parents=True)
        (out / name / "1" / "model.py").symlink_to(model / "1" / "model.py")
        config = (model / "config.pbtxt").read_text()
        if model.name == CORE:
            config = config.replace(f'name: "{CORE}"', f'name: "{name}"', 1)
        if model.name in DECOUPLED:
            config = config.replace("decoupled: true", f"decoupled: {str(decoupled).lower()}")
        config = config.replace('key: "tensorrt_llm_model_name" value: { string_value: "lora_llm" }',
                                f'key: "tensorrt_llm_model_name" value: {{ string_value: "{core_name}" }}')
        (out / name / "config.pbtxt").write_text(config)
    return out


def repository(out: Path, decoupled: bool = True, core_name: str = CORE) -> Path:
    """model_repository/ itself for the defaults, else a rendered copy in `out`."""
    return SOURCE if decoupled and core_name == CORE else render(out, decoupled, core_name)


def parse_bool(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--decoupled_mode", type=parse_bool, default=True)
    parser.add_argument("--tensorrt_llm_model_name", default=CORE)
    args = parser.parse_args()
    print(render(args.out, args.decoupled_mode, args.tensorrt_llm_model_name))


if __name__ == "__main__":
    main()
