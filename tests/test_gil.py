"""lorakit.peft.gil: readers beside a stepping engine pause once per EVERY of work, only inside yielding()."""

from __future__ import annotations

import threading

import pytest

from lorakit.peft import gil


@pytest.fixture
def clock(monkeypatch):
    """gil's clock and sleep replaced: time moves only when the test says, and each sleep is recorded."""
    state = {"now": 100.0, "sleeps": []}
    monkeypatch.setattr(gil.time, "perf_counter", lambda: state["now"])
    monkeypatch.setattr(gil.time, "sleep", lambda s: state["sleeps"].append(s))
    return state


def test_pause_does_nothing_outside_yielding(clock):
    for _ in range(3):
        clock["now"] += 1.0
        gil.pause()
    assert clock["sleeps"] == [] and not gil.yielding_here()


def test_a_yielding_thread_pauses_once_per_every_of_work(clock):
    with gil.yielding():
        assert gil.yielding_here()
        gil.pause()  # no work yet
        clock["now"] += gil.EVERY / 2
        gil.pause()
        assert clock["sleeps"] == []
        clock["now"] += gil.EVERY  # past due
        gil.pause()
        assert clock["sleeps"] == [gil.PAUSE]
        gil.pause()  # the next is due EVERY after this one
        clock["now"] += gil.EVERY * 3  # one long piece of work: one pause after it
        gil.pause()
        gil.pause()
        assert clock["sleeps"] == [gil.PAUSE, gil.PAUSE]
    assert not gil.yielding_here()
    clock["now"] += 1.0
    gil.pause()
    assert len(clock["sleeps"]) == 2


def test_nested_yielding_ends_with_the_outermost_and_survives_an_error(clock):
    with pytest.raises(KeyError):
        with gil.yielding():
            with gil.yielding():
                pass
            assert gil.yielding_here()
            raise KeyError("x")
    assert not gil.yielding_here()


def test_beside_runs_the_call_yielding_on_its_own_thread_only(clock):
    seen = {}

    def work(a, b):
        seen["here"] = gil.yielding_here()
        other = threading.Thread(target=lambda: seen.setdefault("other", gil.yielding_here()))
        other.start()
        other.join()
        return a + b

    assert gil.beside(work, 2, 3) == 5
    assert seen == {"here": True, "other": False} and not gil.yielding_here()


def test_hashing_gives_the_same_digest_yielding_or_not(clock):
    torch = pytest.importorskip("torch")
    from lorakit.adapters import snapshot

    class Image:  # hash_image reads only the packed buffer
        buffer = torch.randint(0, 256, (3 * snapshot._HASH_CHUNK + 12345,), dtype=torch.uint8)

    plain = snapshot.hash_image(b'{"r": 16}', Image)()
    with gil.yielding():
        clock["now"] += 1.0
        assert snapshot.hash_image(b'{"r": 16}', Image)() == plain
    assert plain != snapshot.hash_image(b'{"r": 8}', Image)()
