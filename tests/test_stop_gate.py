"""The processes' half of a stop at a step boundary agreed while chunks are queued (no cluster)."""

import threading
import time

from ray_elastic.decide import stop_lead_steps
from ray_elastic.slice.stop_gate import StopGate


def _step_in_thread(gate: StopGate, step: int) -> tuple[list[bool], threading.Thread]:
    """A step loop asking the gate for ``step`` on its own thread (it may hold)."""
    out: list[bool] = []
    t = threading.Thread(target=lambda: out.append(gate.stops_before(step)))
    t.start()
    return out, t


def test_an_accepted_stop_ends_the_steps_at_it_and_every_later_chunk():
    gate = StopGate()
    assert not gate.stops_before(10)
    assert gate.propose(14) == {"accepted": True, "started": 10}
    gate.decide(True)
    assert [s for s in range(11, 20) if not gate.stops_before(s)] == [11, 12, 13]
    assert gate.stops_before(30)  # a chunk queued beyond it runs nothing
    assert not gate.propose(40)["accepted"]  # stopped: nothing more to agree on


def test_a_started_step_refuses_the_stop_and_the_process_goes_on():
    gate = StopGate()
    for s in range(8):
        assert not gate.stops_before(s)
    assert gate.propose(7) == {"accepted": False, "started": 7}
    assert not gate.stops_before(8)


def test_a_process_holds_before_the_proposed_step_until_the_controller_decides():
    gate = StopGate()
    gate.propose(3)
    out, t = _step_in_thread(gate, 3)
    time.sleep(0.2)
    assert out == []  # holding: another process may have refused
    assert not gate.stops_before(2)  # steps before it are not held
    gate.decide(False)  # one refused: everyone goes on
    t.join(5)
    assert out == [False]


def test_a_later_proposal_replaces_a_refused_one_and_releases_the_held_step():
    gate = StopGate()
    gate.propose(3)
    out, t = _step_in_thread(gate, 3)
    time.sleep(0.1)
    assert gate.propose(6)["accepted"]  # another process had started step 3: proposed again further on
    t.join(5)
    assert out == [False]
    gate.decide(True)
    assert [gate.stops_before(s) for s in (4, 5, 6)] == [False, False, True]


def test_the_proposal_lies_past_what_runs_while_the_driver_hears_of_a_step():
    assert stop_lead_steps([0.2] * 10, 0.2) == 4  # 2 + (0.2 + 0.15) / 0.2
    assert stop_lead_steps([0.04] * 10, 0.2) == 11
    assert stop_lead_steps([], 0.2) == 10  # no step time yet: about a chunk
