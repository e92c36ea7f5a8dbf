"""The quickstart notebook runs end to end on CPU in its reduced mode (papermill-style parameters).

Like papermill, the test inserts a cell with the CI parameters right after the cell tagged
``parameters`` and executes the notebook with ``nbclient``; it then checks what the notebook
wrote (learning curves, coefficient batches, heatmap page, statistics, evaluation JSON).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="pip install nbformat nbclient ipykernel")
nbclient = pytest.importorskip("nbclient", reason="pip install nbformat nbclient ipykernel")
pytest.importorskip("ipykernel", reason="pip install ipykernel")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"
CI_OVERRIDES = [
    "model.demo_warmup_steps=30",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=24",
    "reward.num_workers=0",
    "run.eval_every=0",
    "run.save_every=1",
    "run.progress=false",
    "run.tensorboard=false",
]


def _with_parameters(nb, **params):
    index = next(
        i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])
    )
    source = "# Injected parameters\n" + "".join(f"{k} = {v!r}\n" for k, v in params.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(index + 1, cell)
    return nb


def test_notebook_structure():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1 and "REDUCED = False" in tagged[0].source
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "clear outputs"


@pytest.mark.slow
def test_notebook_runs_in_reduced_cpu_mode(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    run_dir = tmp_path / "run"
    _with_parameters(
        nb,
        REDUCED=True,
        INSTALL=False,
        RUN_DIR=str(run_dir),
        STEPS=2,
        OVERRIDES=CI_OVERRIDES,
        QWEN3_DIR=str(tmp_path / "absent"),
    )
    client = nbclient.NotebookClient(
        nb,
        timeout=900,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parents[1])}},
    )
    client.execute()
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert (run_dir / "learning_curve.png").stat().st_size > 5000
    assert (run_dir / "delta_stats.png").stat().st_size > 5000
    batches = sorted(p.name for p in (run_dir / "diagnostics").glob("batch_*.npz"))
    assert batches == ["batch_000000.npz", "batch_000001.npz", "batch_000002.npz"]
    page = (run_dir / "diagnostics" / "heatmap.html").read_text()
    assert page.count('class="tok"') > 0
    results = json.loads((run_dir / "eval.json").read_text())
    assert results["benchmarks"]["addition"]["problems"] == 8
    # The images and the heatmap were displayed in the notebook.
    kinds = {k for c in nb.cells for o in c.get("outputs", []) for k in o.get("data", {})}
    assert {"image/png", "text/html"} <= kinds
