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
