"""fomoepy.experts.read_ahead: guesses fed to the drives a few at a time, handed to their step or dropped;
each test on the definition (PyReadAhead) and on the compiled ReadAhead where built."""

import threading
from concurrent.futures import Future

import pytest

from fomoepy.experts import read_ahead
from fomoepy.experts.read_ahead import PyReadAhead

# the definition, and the compiled one (fomoepy/experts/_reads.c) where setup.py built it
AHEADS = [PyReadAhead] + ([read_ahead.ReadAhead] if read_ahead.ReadAhead is not PyReadAhead else [])


def ids(c) -> str:
    return "python" if c is PyReadAhead else "compiled"


class Drive:
    """submit() hands out futures the test completes by hand."""

    def __init__(self):
        self.issued: list[tuple[int, int]] = []
        self.futures: dict[tuple[int, int], Future] = {}

    def submit(self, layer: int, expert: int, prepared=None) -> Future:
        self.issued.append((layer, expert))
        f = self.futures[(layer, expert)] = Future()
        return f

    def land(self, layer: int, expert: int) -> None:
        self.futures[(layer, expert)].set_result(("bytes of", layer, expert))


@pytest.mark.parametrize("ReadAhead", AHEADS, ids=ids)
def test_a_landing_read_issues_the_next_guess_in_order(ReadAhead):
    drive = Drive()
    ahead = ReadAhead(drive.submit, depth=2)
    ahead.queue(4, [9, 1, 7, 3])
    assert drive.issued == [(4, 9), (4, 1)] and ahead.in_flight == 2
    drive.land(4, 1)  # the second lands first: one more goes out
    assert drive.issued == [(4, 9), (4, 1), (4, 7)] and ahead.in_flight == 2
    # a read landing on another thread (a store's reader) issues the next from there
    t = threading.Thread(target=drive.land, args=(4, 9))
    t.start()
    t.join()
    assert drive.issued[-1] == (4, 3)


@pytest.mark.parametrize("ReadAhead", AHEADS, ids=ids)
def test_reads_that_land_as_they_are_issued_free_the_drive_at_once(ReadAhead):
    """A store that completes a read on the issuing thread (a null store, a cached read): each frees its
    place, so every guess goes out, one after another, and none stays counted in flight."""

    def at_once(layer: int, expert: int, prepared=None) -> Future:
        issued.append((layer, expert))
        f: Future = Future()
        f.set_result(("bytes of", layer, expert))
        return f

    issued: list[tuple[int, int]] = []
    ahead = ReadAhead(at_once, depth=2)
    ahead.queue(4, [9, 1, 7, 3])
    assert issued == [(4, 9), (4, 1), (4, 7), (4, 3)] and ahead.in_flight == 0
    ahead.queue(5, [2, 6, 8])  # the depth is whole again for the next layer's guesses
    assert issued[4:] == [(5, 2), (5, 6), (5, 8)] and ahead.in_flight == 0
    assert sorted(ahead.take(5, [6, 8])) == [6, 8]


@pytest.mark.parametrize("ReadAhead", AHEADS, ids=ids)
def test_take_hands_over_the_chosen_reads_and_drops_the_other_guesses(ReadAhead):
    drive = Drive()
    ahead = ReadAhead(drive.submit, depth=2)
    ahead.queue(4, [9, 1, 7, 3])
    taken = ahead.take(4, [1, 3, 5])
    assert taken == {1: drive.futures[(4, 1)]}  # 3 was never issued: the step reads it itself
    drive.land(4, 9)
    drive.land(4, 1)
    assert drive.issued == [(4, 9), (4, 1)]  # 7 and 3 were dropped unread
    c = ahead.counts
    assert (c.issued, c.used, c.wasted, c.skipped) == (2, 1, 1, 2) and ahead.in_flight == 0
    # by position in the reading order: 9 (first, wrong) and 1 (second, taken) were read
    assert (c.read_at, c.used_at) == ([1, 1], [0, 1])
    ahead.queue(5, [2, 4])
    ahead.take(5, [2])
    assert (c.read_at, c.used_at) == ([2, 2], [1, 1])


@pytest.mark.parametrize("ReadAhead", AHEADS, ids=ids)
def test_guesses_for_a_step_that_never_came_do_not_linger(ReadAhead):
    drive = Drive()
    ahead = ReadAhead(drive.submit, depth=4)
    ahead.queue(2, [5, 6])
    drive.land(2, 5)
    ahead.queue(3, [8])  # the step of layer 2 never took its guesses (e.g. it failed)
    assert ahead.take(2, [5, 6]) == {} and ahead.counts.wasted == 2
    assert set(ahead.take(3, [8])) == {8}


@pytest.mark.parametrize("ReadAhead", AHEADS, ids=ids)
def test_a_step_waits_for_a_guess_being_issued_rather_than_read_it_again(ReadAhead):
    # a reader thread is inside submit() for guess (1, 4) when the step takes layer 1: the step must get
    # that read (filed a moment later), not miss it and read expert 4 a second time
    inside, go_on = threading.Event(), threading.Event()
    drive = Drive()

    def slow_submit(layer, expert, prepared):
        if (layer, expert) == (1, 4):
            inside.set()
            go_on.wait(5)
        return drive.submit(layer, expert)

    ahead = ReadAhead(slow_submit, depth=1)
    ahead.queue(1, [2, 4])
    landing = threading.Thread(target=drive.land, args=(1, 2))  # its callback issues (1, 4)
    landing.start()
    assert inside.wait(5)
    taken = {}
    taker = threading.Thread(target=lambda: taken.update(ahead.take(1, [4])))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive()  # it waits for the guess to be filed
    go_on.set()
    taker.join(5)
    landing.join(5)
    assert set(taken) == {4} and taken[4] is drive.futures[(1, 4)]


@pytest.mark.parametrize("ReadAhead", AHEADS, ids=ids)
def test_close_issues_nothing_more_and_a_depth_below_one_is_refused(ReadAhead):
    drive = Drive()
    ahead = ReadAhead(drive.submit, depth=1)
    ahead.queue(0, [1, 2])
    ahead.close()
    drive.land(0, 1)
    ahead.queue(1, [3])  # a late prediction (an engine closing mid-step)
    assert drive.issued == [(0, 1)]
    with pytest.raises(ValueError, match="depth must be >= 1"):
        ReadAhead(drive.submit, depth=0)


@pytest.mark.parametrize("ReadAhead", AHEADS, ids=ids)
def test_what_a_read_needs_is_made_on_the_queuing_thread_and_the_read_issued_on_the_landing_one(ReadAhead):
    # a GPU device's pinned buffers are the inference thread's alone: a guess's buffer is taken when it is
    # queued, even when its read is issued later by a store's thread as the one before it lands
    drive = Drive()
    made, used = [], []

    def prepare(layer, expert):
        made.append(threading.get_ident())
        return ("buffer for", expert)

    def submit(layer, expert, prepared):
        used.append((prepared, threading.get_ident()))
        return drive.submit(layer, expert)

    ahead = ReadAhead(submit, depth=1, prepare=prepare)
    ahead.queue(0, [7, 8])
    landing = threading.Thread(target=drive.land, args=(0, 7))
    landing.start()
    landing.join()
    me = threading.get_ident()
    assert made == [me, me] and used[0] == (("buffer for", 7), me)
    assert used[1][0] == ("buffer for", 8) and used[1][1] == landing.ident



@pytest.mark.parametrize("ReadAhead", AHEADS, ids=ids)
def test_a_list_of_prepares_gives_each_guess_what_its_layer_makes(ReadAhead):
    # prepare as one callable per layer (the streamer's read buffers, each of its layer's size), called with
    # no arguments, on the queuing thread, once per guess, in order
    drive = Drive()
    made, used = [], []

    def buffer_of(layer):
        def take():
            made.append((layer, threading.get_ident()))
            return f"buffer {len(made)} of layer {layer}"

        return take

    def submit(layer, expert, prepared):
        used.append((layer, expert, prepared))
        return drive.submit(layer, expert)

    ahead = ReadAhead(submit, depth=1, prepare=[buffer_of(layer) for layer in range(3)])
    ahead.queue(2, [7, 8])
    me = threading.get_ident()
    assert made == [(2, me), (2, me)] and used == [(2, 7, "buffer 1 of layer 2")]
    drive.land(2, 7)
    assert used[1] == (2, 8, "buffer 2 of layer 2")
    with pytest.raises(IndexError):
        ahead.queue(3, [1])  # no layer 3 among the prepares: the guesses of layer 2 stay as they were
    assert ahead.take(2, {8: None}).keys() == {8}

@pytest.mark.parametrize("ReadAhead", AHEADS, ids=ids)
@pytest.mark.parametrize("as_list", [False, True], ids=["function", "list"])
def test_with_prepare_anywhere_a_guess_takes_what_its_read_needs_as_it_is_issued_and_a_dropped_one_nothing(ReadAhead, as_list):
    # the cpu device's read arena may be taken from on any thread: a guess's buffer is taken by the thread
    # that issues its read, and the guesses a step drops unissued (most of them) take none
    drive = Drive()
    made, used = [], []

    def prepare(layer, expert=None):
        made.append((layer, expert, threading.get_ident()))
        return f"buffer {len(made)}"

    def submit(layer, expert, prepared):
        used.append((expert, prepared))
        return drive.submit(layer, expert)

    prepares = [lambda layer=layer: prepare(layer) for layer in range(3)] if as_list else prepare
    ahead = ReadAhead(submit, depth=1, prepare=prepares, prepare_anywhere=True)
    ahead.queue(2, [7, 8, 9])
    me = threading.get_ident()
    assert made == [(2, None if as_list else 7, me)] and used == [(7, "buffer 1")]  # the one issued, no more
    landing = threading.Thread(target=drive.land, args=(2, 7))
    landing.start()
    landing.join()
    assert made[1] == (2, None if as_list else 8, landing.ident) and used[1] == (8, "buffer 2")
    assert ahead.take(2, {8: None}).keys() == {8}  # 9 dropped unissued: nothing was made for it
    assert len(made) == 2 and ahead.counts.skipped == 1
    if as_list:
        with pytest.raises(IndexError):
            ahead.queue(3, [1])  # no layer 3 among the prepares: refused as it is queued, as before


@pytest.mark.parametrize("ReadAhead", AHEADS, ids=ids)
def test_with_prepare_anywhere_a_failing_prepare_is_a_refused_read(ReadAhead):
    # made as the guess is issued, a prepare that fails fails as its submit would: a RuntimeError (a closed
    # pool) leaves the guess unissued and the drive free, and issues nothing more for now; any other error
    # is raised to the caller, the drive free too
    drive = Drive()
    failures = [RuntimeError("closed"), None, ValueError("bad")]

    def prepare(layer, expert):
        error = failures.pop(0)
        if error is not None:
            raise error
        return "buffer"

    ahead = ReadAhead(lambda layer, expert, prepared: drive.submit(layer, expert), depth=2, prepare=prepare, prepare_anywhere=True)
    ahead.queue(0, [1, 2])
    assert drive.issued == [] and ahead.in_flight == 0 and ahead.counts.issued == 1
    ahead.queue(1, [3])
    assert drive.issued == [(1, 3)] and ahead.in_flight == 1
    with pytest.raises(ValueError, match="bad"):
        ahead.queue(2, [5])
    assert ahead.in_flight == 1 and drive.issued == [(1, 3)]  # 3's read still holds its drive; 5's none


def test_the_gate_turns_reading_ahead_off_below_the_share_that_pays_and_on_again_above_it():
    from fomoepy.experts.read_ahead import ReadAheadGate

    gate = ReadAheadGate(0.44, window=100, sample=4)
    assert gate.margin == 2 * (0.44 * (1 - 0.44) / 100) ** 0.5  # two standard errors of a window's share (the same float ops)
    assert gate.reading and gate.predicting
    gate.score(60, 20)
    assert gate.reading and gate.share is None  # no verdict before a window's guesses
    gate.score(40, 20)  # 40 % right over the window: below the line, not by the margin
    assert gate.reading and gate.share == 0.40
    gate.score(100, 30)  # 30 %: off
    assert not gate.reading and gate.turned == 1
    # while off, one decode token in four still predicts (and is scored as if read)
    predicting = []
    for _ in range(8):
        predicting.append(gate.predicting)
        gate.tick()
    assert predicting == [True, False, False, False] * 2
    gate.score(100, 48)  # 48 %: above the line, not by the margin: stays off
    assert not gate.reading
    gate.score(100, 60)
    assert gate.reading and gate.turned == 2 and (gate.guessed, gate.right) == (400, 178)
    assert gate.keeps_reading(0.40) and not gate.keeps_reading(0.30)  # a gate that starts on, at a steady share
    with pytest.raises(ValueError):
        ReadAheadGate(1.0)
