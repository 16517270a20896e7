"""The arrangement study's shortcut audit: every shortcut at chance, the relation itself not, and its report."""

from studies.arrangement import shortcuts


def test_audit_shortcuts_stay_at_chance_and_the_relation_does_not(tmp_path):
    rows = shortcuts.audit("all", num_train=3000, num_test=2000, mlp=False)
    by_name = {r["baseline"]: r for r in rows}
    assert {"disc_a", "disc_b", "midpoint", "span", "distance", "ink", "parts", "quadrants", "pixels_logreg",
            "centres_logreg", "grid4", "positions_sorted"} == set(by_name)
    for r in rows:
        assert r["low"] <= r["accuracy"] <= r["high"], r
        if r["shortcut"]:
            assert r["accuracy"] < 0.56, r  # 2000 test images: the 95% interval is about +-2.2 points
    assert by_name["positions_sorted"]["accuracy"] > 0.9 and not by_name["positions_sorted"]["shortcut"]
    shortcuts.write(rows, tmp_path, 1.0, "cmd", (3000, 2000))
    text = (tmp_path / "shortcuts.md").read_text()
    assert "Shortcuts above 55%: none." in text and "| *not shortcuts* |" in text
    assert len((tmp_path / "shortcuts.csv").read_text().splitlines()) == len(rows) + 1


def test_the_long_span_setting_is_audited_on_long_pairs_only():
    rows = shortcuts.audit("long", num_train=2000, num_test=1000, mlp=False)
    assert {r["region"] for r in rows} == {"long"}
    assert all(r["accuracy"] < 0.57 for r in rows if r["shortcut"]), rows


def test_the_report_splits_the_held_out_test_by_class_and_the_unseen_spans_by_bin(tmp_path):
    import numpy as np

    from studies.arrangement import report

    (tmp_path / "predictions").mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for seed in range(3):
        label = rng.integers(2, size=400)
        pred = np.where(label == 1, label, rng.integers(2, size=400))  # every "same" right, "different" by chance
        np.savez(tmp_path / "predictions" / f"held_out-s{seed}.npz", test_label=label, test_pred=pred,
                 test_distance=np.full(400, 15))
        span = rng.integers(21, 33, size=400)
        ood_pred = np.where(span <= 24, label, 1 - label)  # right up to 24 px, wrong beyond
        np.savez(tmp_path / "predictions" / f"ood-s{seed}.npz", test_label=label, test_pred=ood_pred, test_distance=span)
        rows += [{"key": f"held_out-s{seed}", "experiment": "held_out", "model": "m", "val_acc": "0.99",
                  "test_acc": f"{(pred == label).mean():.4f}"},
                 {"key": f"ood-s{seed}", "experiment": "span_ood", "model": "m", "val_acc": "0.98",
                  "test_acc": f"{(ood_pred == label).mean():.4f}"}]
    held = report.held_out_table(rows, tmp_path)[-2]
    cells = [c.strip() for c in held.split("|")[1:-1]]
    assert cells[0] == "m" and cells[1] == "3" and cells[4] == "100.0 [100.0-100.0]"
    assert 40 < float(cells[5].split()[0]) < 60  # the "different" pairs at chance
    ood = [c.strip() for c in report.span_ood_table(rows, tmp_path)[-2].split("|")[1:-1]]
    assert ood[2] == "98.0 [98.0-98.0]" and ood[4] == "100.0 [100.0-100.0]"
    assert ood[5] == "0.0 [0.0-0.0]" and ood[6] == "0.0 [0.0-0.0]"
