"""The relation study's predictions page (studies/relation/visibility.py): where the predicted curve crosses,
and the command that writes the page once, before the runs."""

from pathlib import Path

import numpy as np
import pytest

from studies.relation import visibility
from studies.runner.visibility import predicted_accuracy

TINY = Path(__file__).resolve().parents[1] / "studies/relation/configs/tiny.yaml"


def test_crossings_and_the_predicted_curve_by_hand():
    spans, share = np.array([11, 12, 13, 14, 15]), np.array([1.0, 0.6, 0.4, 0.0, 0.0])
    assert visibility.crossings(spans, share) == {"half": (12, 13), "chance": (13, 14)}
    assert visibility.crossings(spans, np.ones(5)) == {"half": None, "chance": None}
    np.testing.assert_allclose(predicted_accuracy(share, 0.9), [0.9, 0.74, 0.66, 0.5, 0.5])


def test_the_cli_writes_the_predictions_once_and_refuses_to_overwrite_them(tmp_path, capsys):
    out = tmp_path / "predictions.md"
    visibility.main(["--config", str(TINY), "--out", str(out)])
    text = out.read_text()
    assert "| cnn-rf5 | 5 | 32x32 |" in text
    with pytest.raises(SystemExit) as err:
        visibility.main(["--config", str(TINY), "--out", str(out)])
    assert err.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {out} exists; predictions are written once, before the runs: move it away or choose another --out"
    )
    assert out.read_text() == text
