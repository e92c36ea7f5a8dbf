"""A user's program: a reward written as a lambda in ``__main__``, prompts as a list of dicts.

``python tests/rl/api_script.py MODEL_DIR RUN_DIR step N`` runs N steps through
``Trainer.step()`` and prints each metrics row as JSON; ``... train N`` runs ``trainer.train()``
to N steps (resuming from the run directory's checkpoint, as the CLI does).
"""

import json
import random
import sys
import time

from delta_jax import Trainer


def rows(n: int = 64) -> list[dict]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "level": a % 3})
    return out


# Partial credit for the right number of digits; the dataset's `level` column arrives as a list;
# a short sleep per group call leaves a test time to kill the run between two saves.
reward = lambda prompts, completions, answer, level, **columns: (
    time.sleep(0.05) or [float(len(c.strip()) == len(a)) / (1 + lv) for c, a, lv in
                         zip(completions, answer, level, strict=True)]
)  # fmt: skip


if __name__ == "__main__":
    model_dir, run_dir, mode, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    config = {
        "model.path": model_dir,
        "run.dir": run_dir,
        "run.steps": steps,
        "run.save_every": 1,
        "run.eval_every": 0,
        "run.progress": False,
        "run.tensorboard": False,
        "rollout.prompts_per_step": 4,
        "rollout.samples_per_prompt": 4,
        "rollout.max_new_tokens": 8,
        "data.max_prompt_length": 16,
        "optim.lr": 1e-3,
    }
    with Trainer(config, train_dataset=rows(), reward_fns=[reward]) as trainer:
        if mode == "step":
            for _ in range(steps):
                print(json.dumps(trainer.step()), flush=True)
        else:
            trainer.train()
