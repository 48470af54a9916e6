"""The README's notebook example runs as written."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.soak  # the same steps run in the default suite as the notebook, in a kernel (test_notebook.py)
def test_quickstart_example_trains_and_learns():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.join(ROOT, "examples"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"loss ([\d.]+) -> ([\d.]+) in 100 steps", proc.stdout)
    assert m, proc.stdout[-2000:]
    first, last = map(float, m.groups())
    assert last < 0.2 * first
    # Second half: a slice is killed and the run recovers without rewinding.
    m = re.search(r"training again after ([\d.]+)s on 2 slices, 0 steps rewound, 100 steps done", proc.stdout)
    assert m, proc.stdout[-2000:]
    png = re.search(r"timeline: (\S+\.png)", proc.stdout).group(1)
    assert os.path.getsize(png) > 10_000


def test_the_digits_task_reads_scikit_learns_digits_without_importing_it(tmp_path):
    """Every slice process loads the example task's data: importing scikit-learn there cost ~1 s of
    CPU per process. Same arrays as ``sklearn.datasets.load_digits``; scikit-learn stays unimported."""
    import numpy as np
    from sklearn.datasets import load_digits

    code = (
        "import sys; from ray_elastic.examples.digits_mlp import load_digits; x, y = load_digits(); "
        "assert 'sklearn' not in sys.modules, 'sklearn imported'; "
        "import numpy as np; np.save(sys.argv[1], np.concatenate([x, y[:, None]], axis=1))"
    )
    out = tmp_path / "digits.npy"
    proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours = np.load(out)
    ref = load_digits()
    np.testing.assert_array_equal(ours[:, :-1], ref.data)
    np.testing.assert_array_equal(ours[:, -1], ref.target)
