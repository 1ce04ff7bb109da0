"""`bench spec --vs-llama-server`: llama.cpp's server driven as the CPU peer of speculative decoding. The plumbing is
checked against a stand-in server speaking llama-server's HTTP protocol; a real llama-server (env
SPECJAX_LLAMA_SERVER=path) is checked for the plain greedy tokens specjax gives on the same weights."""

import os
import stat
import sys
import textwrap
import types

import pytest

from specjax.bench import spec as bench_spec
from specjax.bench.llamacpp import LlamaServer

FAKE_SERVER = textwrap.dedent("""\
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    drafting = "--spec-type" in argv
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def _send(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def do_GET(self):
            self._send({"status": "ok"})
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert req["temperature"] == 0.0 and req["top_k"] == 1 and req["return_tokens"]
            toks = [t + 1 for t in req["prompt"]][: req["n_predict"]] + [2]   # 2 = the stop token
            timings = {"predicted_n": len(toks)}
            if drafting:
                timings.update(draft_n=4, draft_n_accepted=2)
            self._send({"tokens": toks, "timings": timings})
    HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def _fake_binary(tmp_path):
    path = tmp_path / "llama-server"
    path.write_text(f"#!{sys.executable}\n" + FAKE_SERVER)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_missing_binary_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="not an executable llama-server"):
        LlamaServer(str(tmp_path / "nope"), "model.gguf", threads=1)


def test_rows_from_a_server_speaking_llama_servers_protocol(tmp_path):
    args = types.SimpleNamespace(vs_llama_server=_fake_binary(tmp_path), draft_gguf="head.gguf", gguf="model.gguf",
                                 model="folder", dtype=None, llama_draft_n_max=(3, 5), llama_draft_p_min=0.0,
                                 max_new_tokens=4)
    prompts = [[10, 11, 12], [20, 21, 22, 23, 24]]
    plain_out = [[11, 12, 13], [21, 22, 23, 99]]   # the second differs from the stand-in's answer
    rows = bench_spec.llama_server_rows(args, prompts, plain_out, stop=(2,))
    assert [r["name"] for r in rows] == ["llama.cpp plain", "llama.cpp EAGLE3 n_max=3", "llama.cpp EAGLE3 n_max=5"]
    assert all(r["same_as_specjax_plain"] == "1/2" for r in rows)
    assert rows[0]["tokens"] == 4 + 5 and rows[0]["tau"] == 1.0 and rows[0]["drafted"] == 0
    # specjax's tau (generated tokens / verify steps): 9 tokens, 2 of them from the prompts' forwards, 4 accepted
    # drafts: 3 verify steps
    assert rows[1]["accepted"] == 4 and rows[1]["drafted"] == 8 and rows[1]["tau"] == pytest.approx(9 / 3)


def test_draft_gguf_is_required(tmp_path):
    args = types.SimpleNamespace(vs_llama_server=_fake_binary(tmp_path), draft_gguf=None)
    with pytest.raises(SystemExit, match="--draft-gguf"):
        bench_spec.llama_server_rows(args, [[1]], [[1]], stop=())


@pytest.mark.skipif(not os.environ.get("SPECJAX_LLAMA_SERVER"), reason="set SPECJAX_LLAMA_SERVER to a llama-server")
def test_real_llama_server_gives_specjax_plain_greedy_tokens():
    from specjax.generate import generate
    from specjax.hub import default_smollm2_path, fetch_smollm2_gguf
    from specjax.models import target
    from specjax.weights import load_model
    if not os.path.isfile(os.path.join(default_smollm2_path(), "config.json")):
        pytest.skip("SmolLM2 not fetched (python -m specjax.convert fetch-smollm2)")
    cfg, params = load_model(default_smollm2_path(), dtype="float32")
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 30, 2]
    ours = generate(target.unstack_layers(params), cfg, [prompt], max_new_tokens=12,
                    stop_token_ids=tuple(cfg.eos_token_ids))[0]
    server = LlamaServer(os.environ["SPECJAX_LLAMA_SERVER"], fetch_smollm2_gguf("float32"), threads=2)
    try:
        theirs, _ = server.complete(prompt, 12)
    finally:
        server.close()
    stop = tuple(cfg.eos_token_ids)
    assert bench_spec._trim(theirs, stop) == bench_spec._trim(list(ours), stop)


def test_runner_steps_times_the_servers_three_steps():
    """``bench spec --runner-steps``: PlainRunner, target-only and tree steps of the server's runners, per batch size,
    on a tiny model (the steps run and advance their states; the table has one row per batch size)."""
    from spec_models import bigram_models, tiny_config
    cfg = tiny_config()
    tp, _, e3, _ = bigram_models(cfg, seed=3)
    rows = bench_spec.runner_step_times(cfg, tp, "EAGLE3", e3, (2, 1, 3), [1, 2], context=12, repeats=1)
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert min(r["plain_ms"], r["target_only_ms"], r["tree_ms"]) > 0
        assert r["target_only_vs_plain"] == pytest.approx(r["target_only_ms"] / r["plain_ms"])
