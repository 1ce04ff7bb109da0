"""bench heldout's served view: the prediction walks the tokens the server generates (first turn, max new tokens)."""

import numpy as np

from specjax.bench.heldout import first_turn_prompts, served_view
from specjax.train.data import TokenizedData


def _data(examples):
    toks = [np.asarray(t, np.int32) for t, _ in examples]
    masks = [np.asarray(m, np.uint8) for _, m in examples]
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in toks])]).astype(np.int64)
    return TokenizedData(np.concatenate(toks), np.concatenate(masks), offsets, {})


def test_served_view_cuts_first_turn_and_new_tokens():
    two_turns = ([1, 2, 3, 10, 11, 12, 13, 14, 4, 5, 20, 21, 22], [0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1])
    short = ([6, 7, 30, 31, 8, 9, 40], [0, 0, 1, 1, 0, 0, 1])
    whole = ([5, 50, 51, 52], [0, 1, 1, 1])
    data = _data([two_turns, short, whole])

    view = served_view(data, limit=3, max_new_tokens=4)
    assert len(view) == 3
    t, m = view.example(0)  # prompt of 3, then 4 of the 5 answer tokens
    assert t.tolist() == [1, 2, 3, 10, 11, 12, 13] and m.tolist() == [0, 0, 0, 1, 1, 1, 1]
    t, m = view.example(1)  # the first answer ends before the limit: cut at the end of the turn
    assert t.tolist() == [6, 7, 30, 31] and m.tolist() == [0, 0, 1, 1]
    t, m = view.example(2)  # one turn to the end of the record
    assert t.tolist() == [5, 50, 51, 52]

    # the prompts served are the view's prompts
    assert first_turn_prompts(data, 3) == [[1, 2, 3], [6, 7], [5]]
    assert len(served_view(data, limit=1, max_new_tokens=100)) == 1
    assert served_view(data, limit=1, max_new_tokens=100).example(0)[0].tolist() == two_turns[0][:8]


def test_negative_sizes_are_refused_before_the_model_loads(capsys):
    """--max-prompts -1 served nothing and divided by zero after minutes of scoring; now one line, exit 2."""
    from specjax.bench.heldout import main
    assert main(["--config", "smollm2-135m", "--draft", "/nonexistent", "--max-prompts", "-1"]) == 2
    assert "error: --max-prompts must be >= 0 and --max-new-tokens >= 1 (got -1 and 256)" in capsys.readouterr().err
