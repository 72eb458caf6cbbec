"""The budget answer cites the run a fresh server meets: where the search confirmed its batch as a fresh load's first
point, that point's job (dsexp.analysis.budget_runs.answer_point)."""

from dsexp.analysis.budget_runs import answer_point


def test_an_answer_confirmed_in_a_fresh_load_cites_the_fresh_load():
    config = {
        "points": [
            {"batch": 10, "status": "ok", "job": "j/4", "first": True},
            {"batch": 11, "status": "ok", "job": "j/4", "first": False},
            {"batch": 11, "status": "ok", "job": "j/5", "first": True},
            {"batch": 12, "status": "oom", "job": "j/4", "first": False},
        ]
    }
    assert answer_point(config, 11)["job"] == "j/5"
    assert answer_point(config, 10)["job"] == "j/4"
    assert answer_point(config, 12) is None  # it never ran
    # records from before points said whether they were their load's first: the first that ran
    old = {"points": [{"batch": 7, "status": "ok", "job": "j/1"}, {"batch": 7, "status": "ok", "job": "j/2"}]}
    assert answer_point(old, 7)["job"] == "j/1"
