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
