"""How many workers a process's memory budget holds."""

from pipeline.memory import plan_workers


def test_workers_fit_the_memory_budget():
    assert plan_workers(10, 1 << 60, None)[0] == 1  # one worker needs more than there is: run one at a time
    workers, facts = plan_workers(10, 1, None)
    assert workers == min(10, facts["cpus"]) and facts["budget_available"] > 0
    assert plan_workers(10, 1, 1)[0] == 1
