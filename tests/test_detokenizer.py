"""IncrementalDetokenizer: the fast tokenizer's own decoder gives the wrapper's text."""

from transformers import AutoTokenizer

from specserve.detokenizer import IncrementalDetokenizer


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    texts = []
    for tok in ids:
        detok.append(tok)
        texts.append(detok.visible_text(False))
    detok.flush()
    return texts + [detok.visible_text(True)]


def test_backend_decoder_streams_the_wrappers_text(default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    prompt = tokenizer.encode("Say it:")
    text = " Grüße, 世界! 🙂 <|im_end|> ok\n\tdone  "
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids  # a special token inside
    fast = IncrementalDetokenizer(tokenizer, prompt, [])
    assert fast._backend_decode is not None  # the default model's tokenizer is a fast one
    slow = IncrementalDetokenizer(tokenizer, prompt, [])
    slow._backend_decode = None  # the transformers wrapper
    assert _stream(fast, ids) == _stream(slow, ids)
    assert fast.text == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_extend_gives_append_one_by_one(default_model_dir):
    """A step's tokens decoded together: the same text at every step boundary, the same stop
    (at the same token) as appending them one by one."""
    import random

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    prompt = tokenizer.encode("Say it:")
    text = " Grüße, 世界! 🙂 <|im_end|> ok\n\tdone  STOP here 🙂🙂 and then some more words"
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    byte_soup = [rng.randrange(0, 400) for _ in range(300)]  # raw byte tokens: split and invalid UTF-8
    assert one_by_one_text(tokenizer, prompt, byte_soup) == tokenizer.decode(
        byte_soup, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    for ids in (ids, byte_soup):
        for stop in ([], ["STOP"], ["界!", "\tdo"], ["not there"]):
            for _ in range(5):
                one = IncrementalDetokenizer(tokenizer, prompt, stop)
                many = IncrementalDetokenizer(tokenizer, prompt, stop)
                at = 0
                while at < len(ids):
                    chunk = ids[at:at + rng.randint(1, 5)]
                    taken, found = many.extend(chunk)
                    expect = None
                    for i, tok in enumerate(chunk):
                        expect = one.append(tok)
                        if expect is not None:
                            assert (taken, found) == (i + 1, expect)
                            break
                    else:
                        assert (taken, found) == (len(chunk), None)
                    assert many.text == one.text and many.visible_text(False) == one.visible_text(False)
                    if found is not None:
                        assert many.visible_text(True) == one.visible_text(True)
                        break
                    at += len(chunk)
                else:
                    many.flush()
                    one.flush()
                    assert many.visible_text(True) == one.visible_text(True) == tokenizer.decode(
                        ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def one_by_one_text(tokenizer, prompt, ids):
    detok = IncrementalDetokenizer(tokenizer, prompt, [])
    for tok in ids:
        detok.append(tok)
    detok.flush()
    return detok.visible_text(True)


# -- stop strings -------------------------------------------------------------------------------

def _reference_stop(text: str, new_from: int, stop: list[str]) -> tuple[int, int] | None:
    """(start, index in `stop`) of the stop string ending after `new_from` that starts
    earliest, ties to the first in `stop`: every occurrence checked one by one."""
    best = None
    for k, s in enumerate(stop):
        for i in range(max(0, new_from - len(s) + 1), len(text) - len(s) + 1):
            if text.startswith(s, i) and (best is None or (i, k) < best):
                best = (i, k)
    return best


def _reference_held(text: str, stop: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    return max((n for s in stop for n in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:n])),
               default=0)


def _random_stops(rng, alphabet: str) -> list[str]:
    """A few stop strings over a small alphabet that overlap: some are prefixes, suffixes or
    infixes of others, some repeat."""
    stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 5))]
    for _ in range(rng.randint(0, 3)):
        s = rng.choice(stop)
        i = rng.randrange(len(s))
        j = rng.randint(i + 1, len(s))
        stop.insert(rng.randrange(len(stop) + 1), rng.choice([s[:j], s[i:], s[i:j], s]))
    return stop


def test_matcher_agrees_with_brute_force():
    """Fed chunk by chunk, the automaton reports the stop string a full search finds among
    those ending in the chunk (and keeps going past it), and holds back the longest tail that
    is a proper prefix of a stop string."""
    import random

    from specserve.detokenizer import StopMatcher

    rng = random.Random(1)
    for trial in range(400):
        alphabet = "ab" if trial % 2 else "abc"
        stop = _random_stops(rng, alphabet)
        matcher = StopMatcher(stop)
        assert matcher.num_states <= 1 + sum(map(len, stop))
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        state, at = 0, 0
        assert matcher.held(state) == 0
        while at < len(text):
            chunk = text[at:at + rng.randint(1, 7)]
            state, index, start = matcher.feed(state, chunk)
            expect = _reference_stop(text[:at + len(chunk)], at, stop)
            assert (None if index < 0 else (at + start, index)) == expect, (stop, text, at)
            at += len(chunk)
            assert matcher.held(state) == _reference_held(text[:at], stop), (stop, text[:at])


def test_matcher_is_shared_per_stop_list():
    import threading

    from specserve.detokenizer import StopMatcher, stop_matcher

    stop = ["shared", "stop", "list", "\u4e16\u754c"]
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(stop_matcher(list(stop)))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(m is got[0] for m in got) and stop_matcher(tuple(stop)) is got[0]
    assert got[0].stop == tuple(stop)
    assert stop_matcher(stop[::-1]) is not got[0]  # the order decides ties, so it is the key
    try:
        StopMatcher(["ok", ""])
    except ValueError as e:
        assert str(e).startswith("stop:")
    else:
        raise AssertionError("an empty stop string was accepted")


def test_matcher_cache_is_bounded(monkeypatch):
    from specserve import detokenizer

    monkeypatch.setattr(detokenizer, "_cache", detokenizer.OrderedDict())
    monkeypatch.setattr(detokenizer, "_cache_chars", 0)
    monkeypatch.setattr(detokenizer, "_CACHE_MAX_CHARS", 100)
    monkeypatch.setattr(detokenizer, "_CACHE_MAX_ENTRIES", 3)
    first = detokenizer.stop_matcher(["x" * 40])
    assert detokenizer.stop_matcher(["y" * 40]) is not first
    assert detokenizer.stop_matcher(["x" * 40]) is first  # now the most recently used
    detokenizer.stop_matcher(["z" * 40])  # 120 characters: the least recently used goes
    assert list(detokenizer._cache) == [("x" * 40,), ("z" * 40,)] and detokenizer._cache_chars == 80
    for s in "abcd":
        detokenizer.stop_matcher([s])
    assert len(detokenizer._cache) == 3 and detokenizer._cache_chars == 3
    detokenizer.stop_matcher(["w" * 500])  # alone over the limit: kept while it is the newest
    assert list(detokenizer._cache) == [("w" * 500,)] and detokenizer._cache_chars == 500


def test_stops_stream_like_the_reference(default_model_dir):
    """Random overlapping stop strings over a small alphabet (with characters split over
    tokens): `append` reports the stop a full search finds in the new text, cuts the text
    there and holds back exactly the longest tail that is a proper prefix of a stop string;
    `extend` with random splits takes the same tokens, reports the same stop and keeps the
    same text and automaton state, each character fed once."""
    import random

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    prompt = tokenizer.encode("Say it:")
    rng = random.Random(2)
    pieces = ["a", "b", "ab", "ba", " a", " b", "aab", "é", "🙂", " ", "b🙂a"]
    for trial in range(120):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(5, 40)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        stop = _random_stops(rng, "ab é🙂")
        if trial % 3 == 0:  # one that surely occurs
            i = rng.randrange(len(text))
            stop.append(text[i:i + rng.randint(1, 6)])
        include = trial % 2 == 1
        one = IncrementalDetokenizer(tokenizer, prompt, stop, include_stop=include)
        many = IncrementalDetokenizer(tokenizer, prompt, stop, include_stop=include)
        at = 0
        found = None
        while at < len(ids) and found is None:
            chunk = ids[at:at + rng.randint(1, 5)]
            taken, found = many.extend(chunk)
            expect = None
            for i, tok in enumerate(chunk):
                before = len(one.text)
                expect = one.append(tok)
                ref = _reference_stop(one.text, before, stop)
                if ref is None:
                    assert expect is None
                    assert one.visible_text(False) == one.text[:len(one.text) - _reference_held(one.text, stop)]
                else:
                    start, k = ref
                    assert expect == stop[k]
                    cut = start + len(stop[k]) if include else start
                    assert one.visible_text(False) == one.visible_text(True) == one.text[:cut]
                    break
            assert (taken, found) == (i + 1, expect)
            assert many.text == one.text and many.visible_text(False) == one.visible_text(False)
            assert many._state == one._state
            assert many.chars_fed == one.chars_fed == len(one.text)
            at += taken
        many.flush()
        one.flush()
        assert many.visible_text(True) == one.visible_text(True)
        if found is None:
            assert one.text == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            assert many.chars_fed == len(many.text)


class _Counted(list):
    """A list that counts reads by index: the matcher's failure links, so a test sees how
    many it followed."""

    reads = 0

    def __getitem__(self, i):
        _Counted.reads += 1
        return super().__getitem__(i)


def test_stop_work_per_step_does_not_grow_with_the_text(default_model_dir):
    """64 stop strings of 1024 characters that a long text keeps almost completing (so the
    held-back tail is ~1000 characters at every step): each character is fed once and the
    failure links followed never outnumber the characters fed, so a step costs what its new
    characters cost, however long the text and the stop strings. Holding back reads one
    number."""
    from specserve.detokenizer import StopMatcher
    from specserve.request import MAX_STOP_CHARS_EACH, MAX_STOP_STRINGS

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    prompt = tokenizer.encode("Say it:")
    unit = " hello world"
    base = (unit * (MAX_STOP_CHARS_EACH // len(unit) + 1))[:MAX_STOP_CHARS_EACH - 1]
    stop = [base + chr(0x4E00 + k) for k in range(MAX_STOP_STRINGS)]
    ids = tokenizer.encode(unit * 1000, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    matcher = StopMatcher(stop)
    matcher._fail = _Counted(matcher._fail)
    detok._matcher = matcher
    _Counted.reads = 0
    at = 0
    rng = __import__("random").Random(3)
    while at < len(ids):
        chunk = ids[at:at + rng.randint(1, 4)]
        assert detok.extend(chunk) == (len(chunk), None)
        at += len(chunk)
        assert detok.chars_fed == len(detok.text)
        assert _Counted.reads <= detok.chars_fed
        reads = _Counted.reads
        visible = detok.visible_text(False)
        assert _Counted.reads == reads  # holding back follows no link
        if at > len(ids) - 4:
            assert len(detok.text) - len(visible) == _reference_held(detok.text, stop) > 1000
    assert len(detok.text) == len(unit) * 1000 and _Counted.reads > 0


def test_stop_limits_in_sampling_params():
    import pytest

    from specserve.request import MAX_STOP_CHARS_EACH, MAX_STOP_STRINGS, SamplingParams

    assert (MAX_STOP_STRINGS, MAX_STOP_CHARS_EACH) == (64, 1024)
    SamplingParams(stop=["x" * MAX_STOP_CHARS_EACH] * MAX_STOP_STRINGS, stop_token_ids=list(range(1024)))
    for bad in (["x"] * (MAX_STOP_STRINGS + 1), ["ok", "x" * (MAX_STOP_CHARS_EACH + 1)], ["ok", ""], [3]):
        with pytest.raises(ValueError, match="^stop: "):
            SamplingParams(stop=bad)
    for bad in ([-1], [1.0], ["7"], [True], list(range(1025))):
        with pytest.raises(ValueError, match="^stop_token_ids: "):
            SamplingParams(stop_token_ids=bad)
    params = SamplingParams()
    params.stop = ["y"] * (MAX_STOP_STRINGS + 1)  # validate() runs again at submission
    with pytest.raises(ValueError, match="^stop: at most 64 stop strings, got 65"):
        params.validate()
