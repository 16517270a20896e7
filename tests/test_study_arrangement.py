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
