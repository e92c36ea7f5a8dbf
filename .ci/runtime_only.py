"""The runtime-only check (.ci/runtime-only runs it in a virtual environment without the test
extras): the documented real-model path up to its first prompts, and the demo's first step.

A runtime import that only the test extras satisfy (PyTorch brings jinja2, for one) fails
here, as it fails for a user who installed the package alone.

    python .ci/runtime_only.py RUNS_DIR
"""

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

TEST_ONLY = ("torch", "pytest", "hypothesis", "peft", "mkdocs", "nbclient")


def main(runs: Path) -> None:
    present = [m for m in TEST_ONLY if importlib.util.find_spec(m) is not None]
    assert not present, f"not a runtime-only environment: {present} are installed"

    t0 = time.perf_counter()
    from delta_jax import Trainer
    from delta_jax.config import load_config

    # The real-model config: its pinned GGUF model, its chat template, its reasoning-gym data
    # and reward. Building the trainer loads, renders and tokenises; no step is taken.
    config = load_config("configs/smollm2_arith.yaml", [f"run.dir={runs / 'smollm2'}"])
    with Trainer(config) as trainer:
        parts = trainer.parts
        ids, record = parts.eval_prompt_ids[0], parts.eval_records[0]
        text = parts.tokenizer.decode(ids)
        assert record.prompt in text and "<|im_start|>assistant" in text, text
        print(
            f"real model: {len(parts.eval_prompt_ids)} held-out prompts tokenised, the first "
            f"{len(ids)} tokens: {text!r} ({time.perf_counter() - t0:.0f} s)"
        )

    # The built-in demo's first step through the command line (a short warm-up).
    t0 = time.perf_counter()
    cli = str(Path(sys.executable).parent / "delta-jax")
    demo = [
        cli,
        "train",
        "--config",
        "configs/demo.yaml",
        f"run.dir={runs / 'demo'}",
        "run.steps=1",
        "run.eval_every=0",
        "model.demo_warmup_steps=20",
    ]
    subprocess.run(demo, check=True)
    print(f"demo: first step done ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
