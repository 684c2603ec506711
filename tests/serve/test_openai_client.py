#!/usr/bin/env python3
"""`loom serve` through the official `openai` Python client (and raw HTTP for what the SDK hides).

Starts the server on the default model with a random LoRA adapter and an API key, then checks models,
completions and chat (plain and streamed, usage, n, logprobs, seeds), adapters per request and loaded /
unloaded at run time, tokenize/detokenize, metrics, the OpenAI error objects of bad input, cancellation
on disconnect (streamed or not), slow clients that must not starve others, adapter files that escape
--adapter-dir or hold non-finite weights, and a clean stop on SIGTERM.

Usage: test_openai_client.py --loom build/loom --model models/SmolLM2-135M-Instruct.Q4_1.gguf
Exit code 77 (ctest: skipped) when the `openai` package or the model is missing.
"""
import argparse
import base64
import http.client
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

try:
    import openai
except ImportError:  # reported by main()
    openai = None

ARGS = None
SERVER = None
API_KEY = "test-key-123"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(path, seed, r=8, layers=30, scale=0.05):
    """A random PEFT LoRA folder for SmolLM2-135M (plain Python: no numpy/torch)."""
    os.makedirs(path, exist_ok=True)
    io = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
          "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}
    rng = random.Random(seed)
    header, blobs, off = {}, [], 0
    for layer in range(layers):
        for t in TARGETS:
            inp, out = io[t]
            part = "self_attn" if t[0] in "qkvo" else "mlp"
            for ab, shape in (("A", [r, inp]), ("B", [out, r])):
                n = shape[0] * shape[1]
                data = struct.pack(f"<{n}f", *(rng.gauss(0, scale) for _ in range(n)))
                name = f"base_model.model.model.layers.{layer}.{part}.{t}.lora_{ab}.weight"
                header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(data)]}
                blobs.append(data)
                off += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": TARGETS,
                   "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": "SmolLM2-135M-Instruct"}, f)


class Server:
    def __init__(self, loom, model, adapter_root, extra=()):
        self.adapter_root = adapter_root
        write_adapter(os.path.join(adapter_root, "style"), 1)
        write_adapter(os.path.join(adapter_root, "late"), 2)
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [loom, "serve", "-m", model, "--port", "0", "-t", "2", "--api-key", API_KEY,
               "--served-model-name", "smol", "--adapter", f"style={adapter_root}/style",
               "--adapter-dir", adapter_root, "--max-model-len", "1024", "--log-file", self.log.name,
               "--shutdown-grace", "5", *extra]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        line = self.proc.stderr.readline()
        m = re.search(r"http://([\d.]+):(\d+)", line)
        if not m:
            raise RuntimeError(f"loom serve did not start: {line}{self.proc.stderr.read()}")
        self.port = int(m.group(2))
        self.base = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def raw(self, method, path, body=None, key=API_KEY, raw_body=None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = raw_body if raw_body is not None else (json.dumps(body) if body is not None else None)
        c.request(method, path, body=data, headers=headers)
        r = c.getresponse()
        text = r.read().decode()
        c.close()
        return r.status, text

    def metric(self, name):
        status, text = self.raw("GET", "/metrics")
        assert status == 200
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)


    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = -1
        self.proc.stderr.close()
        self.log.close()
        return rc


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (sum(x * x for x in a) ** 0.5 * sum(y * y for y in b) ** 0.5)


# Greedy prompts for speculation: repetitive (quoting, code editing) and not.
SPEC_PROMPTS = [
    ("chat", "Repeat this paragraph exactly: The quick brown fox jumps over the lazy dog. The dog sleeps in "
             "the sun while the fox runs into the forest, looking for food before the winter comes."),
    ("chat", "Rename the variable x to count in this code and print the whole code:\n"
             "def f(items):\n    x = 0\n    for i in items:\n        x += i\n    return x\n"),
    ("completion", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):"),
    ("chat", "Write a short poem about the sea."),
    ("completion", "1, 2, 3, 4, 5, 6,"),
]


class OpenAIClientTest(unittest.TestCase):
    @property
    def c(self):
        return SERVER.client

    def test_models_lists_base_and_adapters(self):
        ids = [m.id for m in self.c.models.list().data]
        self.assertEqual(ids[0], "smol")
        self.assertIn("style", ids)

    def test_chat_completion(self):
        r = self.c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=12, temperature=0)
        self.assertEqual(r.object, "chat.completion")
        self.assertEqual(r.choices[0].message.role, "assistant")
        self.assertTrue(r.choices[0].message.content)
        self.assertIn(r.choices[0].finish_reason, ("stop", "length"))
        self.assertGreater(r.usage.prompt_tokens, 5)
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)

    def test_streamed_chat_equals_plain_and_reports_usage(self):
        msgs = [{"role": "user", "content": "List three colours."}]
        plain = self.c.chat.completions.create(model="smol", messages=msgs, max_tokens=20, temperature=0)
        chunks = list(self.c.chat.completions.create(model="smol", messages=msgs, max_tokens=20, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        self.assertEqual(text, plain.choices[0].message.content)
        self.assertGreater(len(chunks), 3, "tokens arrive as separate chunks")
        self.assertEqual(chunks[-1].usage.completion_tokens, plain.usage.completion_tokens)
        finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        self.assertEqual(finals, [plain.choices[0].finish_reason])

    def test_completion_n_logprobs_and_seed(self):
        kw = dict(model="smol", prompt="Once upon a time", max_tokens=10, temperature=1.0, n=2, seed=42,
                  logprobs=3)
        a, b = self.c.completions.create(**kw), self.c.completions.create(**kw)
        self.assertEqual(len(a.choices), 2)
        self.assertEqual([ch.text for ch in a.choices], [ch.text for ch in b.choices], "same seed, same text")
        lp = a.choices[0].logprobs
        self.assertEqual(len(lp.tokens), len(lp.token_logprobs))
        # OpenAI's legacy format: the top 3, plus the sampled token when it is not among them.
        self.assertTrue(all(len(t) in (3, 4) for t in lp.top_logprobs))
        self.assertTrue(all(tok in top for tok, top in zip(lp.tokens, lp.top_logprobs)))
        self.assertTrue(all(x <= 0 for x in lp.token_logprobs))
        self.assertEqual(a.usage.completion_tokens, sum(len(ch.logprobs.tokens) for ch in a.choices))

    def test_echo_logprobs_as_lm_evaluation_harness_asks(self):
        # lm-evaluation-harness's loglikelihood request (local-completions): token-id prompts, echo, logprobs=1,
        # max_tokens=1; it sums token_logprobs[ctxlen:-1] and compares each with max(top_logprobs[i].values()).
        status, body = SERVER.raw("POST", "/tokenize", {"model": "smol", "prompt": "The capital of France is Paris"})
        self.assertEqual(status, 200, body)
        ids = json.loads(body)["tokens"]
        prompts = [ids, ids[:3]]
        r = self.c.completions.create(model="smol", prompt=prompts, echo=True, logprobs=1, max_tokens=1,
                                      temperature=0)
        self.assertEqual(len(r.choices), 2)
        for ch, p in zip(sorted(r.choices, key=lambda c: c.index), prompts):
            lp = ch.logprobs
            self.assertEqual(len(lp.tokens), len(p) + 1, "the prompt's tokens, then the sampled one")
            self.assertIsNone(lp.token_logprobs[0])
            self.assertIsNone(lp.top_logprobs[0])
            self.assertTrue(all(x <= 0 for x in lp.token_logprobs[1:]))
            self.assertTrue(all(tok in top for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:])))
            self.assertEqual(lp.text_offset, sorted(lp.text_offset))
            self.assertEqual(lp.text_offset[0], 0)
            self.assertTrue(ch.text.startswith("The capital"))
        full, short = (c.logprobs for c in sorted(r.choices, key=lambda c: c.index))
        self.assertTrue(math.isfinite(sum(full.token_logprobs[3:-1])))
        # The same position without echo: its sampled token and logprob are the short echo's last, and the
        # full prompt's fourth token has the logprob the echo listed for it.
        plain = self.c.completions.create(model="smol", prompt=ids[:3], logprobs=5, max_tokens=1, temperature=0)
        lp = plain.choices[0].logprobs
        self.assertEqual(lp.tokens[0], short.tokens[-1])
        self.assertAlmostEqual(lp.token_logprobs[0], short.token_logprobs[-1], places=4)
        self.assertIn(full.tokens[3], lp.top_logprobs[0])
        self.assertAlmostEqual(lp.top_logprobs[0][full.tokens[3]], full.token_logprobs[3], places=4)

    def test_adapter_per_request_and_runtime_load_unload(self):
        prompt = "The weather today is"
        base = self.c.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=0)
        styled = self.c.completions.create(model="style", prompt=prompt, max_tokens=12, temperature=0)
        self.assertNotEqual(base.choices[0].text, styled.choices[0].text, "the adapter changes the output")
        self.assertEqual(styled.model, "style")
        status, body = SERVER.raw("POST", "/v1/load_lora_adapter",
                                  {"lora_name": "late", "lora_path": os.path.join(SERVER.adapter_root, "late")})
        self.assertEqual(status, 200, body)
        late = self.c.completions.create(model="late", prompt=prompt, max_tokens=4, temperature=0)
        self.assertEqual(late.model, "late")
        status, body = SERVER.raw("POST", "/v1/unload_lora_adapter", {"lora_name": "late"})
        self.assertEqual(status, 200, body)
        with self.assertRaises(openai.NotFoundError):
            self.c.completions.create(model="late", prompt=prompt, max_tokens=4)
        # Paths outside --adapter-dir are refused whatever they contain.
        status, body = SERVER.raw("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"})
        self.assertEqual(status, 400, body)
        self.assertEqual(json.loads(body)["error"]["param"], "lora_path")

    def test_bad_input_gets_openai_errors_and_server_keeps_serving(self):
        cases = [
            (dict(temperature=-1), "temperature"),
            (dict(top_p=1.5), "top_p"),
            (dict(n=1000), "n"),
            (dict(max_tokens=100000), "max_tokens"),
            (dict(logprobs=50), "logprobs"),
        ]
        for extra, param in cases:
            with self.subTest(param=param):
                with self.assertRaises(openai.BadRequestError) as cm:
                    self.c.completions.create(model="smol", prompt="hi", **{"max_tokens": 4, **extra})
                self.assertEqual(cm.exception.body.get("param"), param)
        with self.assertRaises(openai.NotFoundError):
            self.c.completions.create(model="nope", prompt="hi", max_tokens=4)
        with self.assertRaises(openai.BadRequestError):  # prompt over --max-model-len
            self.c.completions.create(model="smol", prompt="word " * 3000, max_tokens=4)
        status, body = SERVER.raw("POST", "/v1/completions", raw_body="{not json")
        self.assertEqual(status, 400)
        self.assertIn("error", json.loads(body))
        status, _ = SERVER.raw("POST", "/v1/completions", raw_body="x" * (17 << 20))
        self.assertEqual(status, 413)
        # Still serving.
        self.assertTrue(self.c.completions.create(model="smol", prompt="hi", max_tokens=2).choices)

    def test_api_key_required_except_health(self):
        self.assertEqual(SERVER.raw("GET", "/health", key=None)[0], 200)
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics"),
                             ("POST", "/tokenize")):
            self.assertEqual(SERVER.raw(method, path, {"model": "smol", "prompt": "x"}, key=None)[0], 401, path)
        bad = openai.OpenAI(base_url=SERVER.base + "/v1", api_key="wrong", max_retries=0)
        with self.assertRaises(openai.AuthenticationError):
            bad.models.list()

    def test_tokenize_detokenize(self):
        status, body = SERVER.raw("POST", "/tokenize", {"model": "smol", "prompt": "Hello world"})
        self.assertEqual(status, 200, body)
        toks = json.loads(body)["tokens"]
        status, body = SERVER.raw("POST", "/detokenize", {"model": "smol", "tokens": toks})
        self.assertEqual(status, 200, body)
        self.assertTrue(json.loads(body)["prompt"].endswith("Hello world"))
        # vLLM's /tokenizer_info, as lm-evaluation-harness's remote tokenizer uses it: the special tokens as
        # text that /tokenize (without special tokens added) turns back into one id each, the chat template.
        status, body = SERVER.raw("GET", "/tokenizer_info")
        self.assertEqual(status, 200, body)
        info = json.loads(body)
        self.assertEqual(info["eos_token"], "<|im_end|>")
        self.assertIn("im_start", info["chat_template"])
        for special in (info["eos_token"], info["bos_token"]):
            status, body = SERVER.raw("POST", "/tokenize", {"prompt": special, "add_special_tokens": False})
            self.assertEqual(status, 200, body)
            self.assertEqual(len(json.loads(body)["tokens"]), 1, special)

    def test_disconnect_mid_stream_frees_kv_cache(self):
        idle = SERVER.metric("loom_kv_cache_usage_ratio")
        c = http.client.HTTPConnection("127.0.0.1", SERVER.port, timeout=60)
        c.request("POST", "/v1/completions", body=json.dumps(
            {"model": "smol", "prompt": "Count: 1, 2, 3,", "max_tokens": 900, "stream": True, "ignore_eos": True}),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        r = c.getresponse()
        for _ in range(5):
            r.readline()
        self.assertGreater(SERVER.metric("loom_kv_cache_usage_ratio"), idle)
        c.sock.close()  # the client goes away mid-stream
        c.close()
        deadline = time.time() + 10
        while time.time() < deadline and SERVER.metric("loom_kv_cache_usage_ratio") > idle:
            time.sleep(0.1)
        self.assertEqual(SERVER.metric("loom_kv_cache_usage_ratio"), idle)
        self.assertEqual(SERVER.metric("loom_requests_running"), 0)

    def test_client_gone_during_non_streaming_request_frees_engine(self):
        idle = SERVER.metric("loom_kv_cache_usage_ratio")
        body = json.dumps({"model": "smol", "prompt": "Count: 1, 2, 3,", "max_tokens": 900, "ignore_eos": True})
        s = socket.create_connection(("127.0.0.1", SERVER.port))
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
        deadline = time.time() + 10
        while time.time() < deadline and SERVER.metric("loom_requests_running") == 0:
            time.sleep(0.02)
        time.sleep(0.3)
        self.assertEqual(SERVER.metric("loom_requests_running"), 1)
        s.close()  # nothing was written yet: only the socket tells the server the client left
        t0 = time.time()
        while time.time() - t0 < 10 and (SERVER.metric("loom_requests_running") > 0 or
                                         SERVER.metric("loom_kv_cache_usage_ratio") > idle):
            time.sleep(0.02)
        self.assertEqual(SERVER.metric("loom_requests_running"), 0)
        self.assertEqual(SERVER.metric("loom_kv_cache_usage_ratio"), idle)
        self.assertLess(time.time() - t0, 1.0, "cancelled within a few scheduler steps")

    def test_slow_clients_do_not_starve_others(self):
        # 70 connections trickling one header line every 0.5 s (stopping by themselves after 3 s).
        socks = []
        for _ in range(70):
            s = socket.create_connection(("127.0.0.1", SERVER.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\n")
            socks.append(s)
        stop = time.time() + 3

        def trickle():
            k = 0
            while time.time() < stop:
                for s in socks:
                    try:
                        s.sendall(f"X-Slow-{k}: 1\r\n".encode())
                    except OSError:
                        pass
                k += 1
                time.sleep(0.5)
        t = threading.Thread(target=trickle)
        t.start()
        try:
            time.sleep(0.3)
            for _ in range(3):
                t0 = time.time()
                self.assertEqual(SERVER.raw("GET", "/health", key=None)[0], 200)
                self.assertLess(time.time() - t0, 1.0)
            self.assertTrue(self.c.completions.create(model="smol", prompt="hi", max_tokens=2).choices)
        finally:
            t.join()
            for s in socks:
                s.close()

    def test_adapter_symlinked_out_of_adapter_dir_or_non_finite_is_refused(self):
        style = os.path.join(SERVER.adapter_root, "style")
        with tempfile.TemporaryDirectory() as outside:
            shutil.copy(os.path.join(style, "adapter_model.safetensors"), outside)
            escape = os.path.join(SERVER.adapter_root, "escape")
            os.makedirs(escape, exist_ok=True)
            shutil.copy(os.path.join(style, "adapter_config.json"), escape)
            os.symlink(os.path.join(outside, "adapter_model.safetensors"),
                       os.path.join(escape, "adapter_model.safetensors"))
            status, body = SERVER.raw("POST", "/v1/load_lora_adapter", {"lora_name": "escape", "lora_path": escape})
            self.assertEqual(status, 400, body)
            err = json.loads(body)["error"]
            self.assertIn("adapter_model.safetensors", err["message"])
            self.assertNotIn(outside, err["message"])
        huge = os.path.join(SERVER.adapter_root, "huge")
        os.makedirs(huge, exist_ok=True)
        shutil.copy(os.path.join(style, "adapter_model.safetensors"), huge)
        with open(os.path.join(style, "adapter_config.json")) as f:
            cfg = json.load(f)
        cfg["lora_alpha"] = 1e308
        with open(os.path.join(huge, "adapter_config.json"), "w") as f:
            json.dump(cfg, f)
        status, body = SERVER.raw("POST", "/v1/load_lora_adapter", {"lora_name": "huge", "lora_path": huge})
        self.assertEqual(status, 400, body)
        self.assertEqual(json.loads(body)["error"]["code"], "adapter_load_failed")
        self.assertIn("lora_alpha", json.loads(body)["error"]["message"])
        ids = [m.id for m in self.c.models.list().data]
        self.assertNotIn("escape", ids)
        self.assertNotIn("huge", ids)

    def test_concurrent_streams(self):
        results = {}

        def one(i):
            r = self.c.completions.create(model="style" if i % 2 else "smol", prompt=f"Item {i}:", max_tokens=8,
                                          temperature=0)
            results[i] = r.choices[0].text
        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(len(results), 8)
        # Each equals the same request made alone.
        for i in (0, 1):
            alone = self.c.completions.create(model="style" if i % 2 else "smol", prompt=f"Item {i}:",
                                              max_tokens=8, temperature=0)
            self.assertEqual(alone.choices[0].text, results[i])

    # ---- /v1/embeddings
    def test_embeddings_shape_norm_and_similarity(self):
        texts = ["The cat sat on the mat.", "A cat was sitting on the mat.",
                 "Quarterly revenue grew by eight percent."]
        r = self.c.embeddings.create(model="smol", input=texts)
        self.assertEqual(r.object, "list")
        self.assertEqual(r.model, "smol")
        self.assertEqual([d.index for d in r.data], [0, 1, 2])
        vecs = [d.embedding for d in r.data]
        for v in vecs:
            self.assertEqual(len(v), 576)
            self.assertAlmostEqual(sum(x * x for x in v), 1.0, places=4)  # L2-normalized, as llama-server
        self.assertGreater(cosine(vecs[0], vecs[1]), cosine(vecs[0], vecs[2]))
        self.assertGreater(r.usage.prompt_tokens, 10)
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens)
        # Batch invariance: each input alone gives the same floats.
        for t, v in zip(texts, vecs):
            self.assertEqual(self.c.embeddings.create(model="smol", input=t).data[0].embedding, v)

    def test_embeddings_base64_token_ids_and_adapters(self):
        text = "Embeddings in base64."
        f = self.c.embeddings.create(model="smol", input=text, encoding_format="float").data[0].embedding
        # Without encoding_format the SDK asks for base64 and decodes it; asked for explicitly, it hands it over.
        self.assertEqual(self.c.embeddings.create(model="smol", input=text).data[0].embedding, f)
        b = self.c.embeddings.create(model="smol", input=text, encoding_format="base64").data[0].embedding
        raw = base64.b64decode(b)
        self.assertEqual(list(struct.unpack(f"<{len(raw) // 4}f", raw)), f)
        status, body = SERVER.raw("POST", "/tokenize", {"model": "smol", "prompt": text})
        ids = json.loads(body)["tokens"]
        by_ids = self.c.embeddings.create(model="smol", input=[ids, ids[:3]])
        self.assertEqual(by_ids.data[0].embedding, f)
        self.assertEqual(by_ids.usage.prompt_tokens, len(ids) + 3)
        styled = self.c.embeddings.create(model="style", input=text).data[0].embedding
        self.assertNotEqual(styled, f, "the adapter changes the hidden states")
        self.assertGreater(cosine(styled, f), 0.5)

    def test_embeddings_bad_input(self):
        for body, param in (({"model": "smol", "input": ""}, "input"), ({"model": "smol", "input": []}, "input"),
                            ({"model": "smol", "input": [1] * 1025}, "input"),
                            ({"model": "smol", "input": "x", "dimensions": 64}, "dimensions"),
                            ({"model": "smol", "input": "x", "encoding_format": "int8"}, "encoding_format")):
            status, text = SERVER.raw("POST", "/v1/embeddings", body)
            self.assertEqual(status, 400, text)
            self.assertEqual(json.loads(text)["error"]["param"], param, text)
        with self.assertRaises(openai.NotFoundError):
            self.c.embeddings.create(model="nope", input="x")

    # ---- speculative decoding
    def test_speculative_server_gives_the_greedy_outputs(self):
        with tempfile.TemporaryDirectory() as root:
            spec = Server(ARGS.loom, ARGS.model, root, extra=["--spec-ngram", "5"])
            try:
                for kind, prompt in SPEC_PROMPTS:
                    if kind == "chat":
                        kw = dict(model="smol", messages=[{"role": "user", "content": prompt}], max_tokens=80,
                                  temperature=0, logprobs=True, top_logprobs=2)
                        want = self.c.chat.completions.create(**kw)
                        got = spec.client.chat.completions.create(**kw)
                        self.assertEqual(got.choices[0].message.content, want.choices[0].message.content)
                        self.assertEqual([t.logprob for t in got.choices[0].logprobs.content],
                                         [t.logprob for t in want.choices[0].logprobs.content])
                        plain_kw = {k: v for k, v in kw.items() if "logprobs" not in k}
                        chunks = spec.client.chat.completions.create(stream=True, **plain_kw)
                        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                        self.assertEqual(streamed, want.choices[0].message.content)
                    else:
                        for n in (80, 7):  # max_tokens cuts inside accepted drafts
                            kw = dict(model="smol", prompt=prompt, max_tokens=n, temperature=0, stop=["\n\n\n"])
                            want = self.c.completions.create(**kw)
                            got = spec.client.completions.create(**kw)
                            self.assertEqual(got.choices[0].text, want.choices[0].text)
                            self.assertEqual(got.usage.completion_tokens, want.usage.completion_tokens)
                            self.assertEqual(got.choices[0].finish_reason, want.choices[0].finish_reason)
                self.assertGreater(spec.metric("loom_spec_decode_accepted_tokens_total"), 0)
                self.assertEqual(SERVER.metric("loom_spec_decode_draft_tokens_total"), 0)
            finally:
                self.assertEqual(spec.stop(), 0)

    def test_metrics_names(self):
        status, text = SERVER.raw("GET", "/metrics")
        self.assertEqual(status, 200)
        for name in ("loom_requests_running", "loom_requests_waiting", "loom_kv_cache_usage_ratio",
                     "loom_prompt_tokens_total", "loom_generation_tokens_total", "loom_requests_finished_total",
                     "loom_time_to_first_token_seconds_bucket", "loom_inter_token_latency_seconds_bucket",
                     "loom_e2e_request_latency_seconds_bucket", "loom_adapters_loaded"):
            self.assertIn(name, text)


def validate(value, schema, defs=None):
    """A tiny JSON Schema check for the keywords the structured-output tests use; raises AssertionError."""
    defs = defs if defs is not None else schema.get("$defs", {})
    if "$ref" in schema:
        return validate(value, defs[schema["$ref"].split("/")[-1]], defs)
    if "enum" in schema:
        assert value in schema["enum"], (value, schema["enum"])
        return
    t = schema.get("type")
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if t in kinds:
        assert isinstance(value, kinds[t]), (value, t)
    elif t == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), (value, t)
    elif t == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (value, t)
    if t == "object":
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            assert k in value, (k, value)
        for k, v in value.items():
            if k in props:
                validate(v, props[k], defs)
            else:
                assert schema.get("additionalProperties", True) is not False, ("extra key", k)
    if t == "integer":
        assert value >= schema.get("minimum", -(1 << 62)) and value <= schema.get("maximum", 1 << 62), (value, schema)
    if t == "string" and "pattern" in schema:
        assert re.search(schema["pattern"], value), (value, schema["pattern"])
    if t == "string" and schema.get("format") == "date":
        assert re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", value), value
    if t == "array":
        assert len(value) >= schema.get("minItems", 0), value
        assert len(value) <= schema.get("maxItems", 1 << 30), value
        for item in value:
            validate(item, schema.get("items", {}), defs)


MATH_SCHEMA = {"type": "object", "properties": {
    "steps": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "explanation": {"type": "string", "maxLength": 80}, "output": {"type": "string", "maxLength": 40}},
        "required": ["explanation", "output"], "additionalProperties": False}},
    "final_answer": {"type": "string", "maxLength": 40}},
    "required": ["steps", "final_answer"], "additionalProperties": False}

EVENT_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 60}, "date": {"type": "string", "maxLength": 30},
    "participants": {"type": "array", "items": {"$ref": "#/$defs/person"}, "maxItems": 4}},
    "required": ["name", "date", "participants"], "additionalProperties": False,
    "$defs": {"person": {"type": "string", "maxLength": 30}}}


class StructuredOutputTest(unittest.TestCase):
    """response_format, llama-server's "grammar" and vLLM's guided_* fields (docs/serving.md)."""

    @property
    def c(self):
        return SERVER.client

    def chat(self, content, **kw):
        kw.setdefault("max_tokens", 300)
        kw.setdefault("temperature", 0)
        return self.c.chat.completions.create(model="smol", messages=[{"role": "user", "content": content}], **kw)

    def test_json_object(self):
        r = self.chat("Describe a cat as JSON with its name and age.", response_format={"type": "json_object"},
                      temperature=0.7, seed=3, max_tokens=200)
        choice = r.choices[0]
        if choice.finish_reason == "stop":
            self.assertIsInstance(json.loads(choice.message.content), dict)
        else:  # cut at max_tokens: still a prefix of an object
            self.assertTrue(choice.message.content.startswith("{"), choice.message.content)

    def test_json_schema_math_reasoning(self):
        r = self.chat("Solve 8x + 7 = -23 step by step.", response_format={
            "type": "json_schema", "json_schema": {"name": "math_reasoning", "schema": MATH_SCHEMA, "strict": True}})
        self.assertEqual(r.choices[0].finish_reason, "stop", r.choices[0].message.content)
        value = json.loads(r.choices[0].message.content)
        validate(value, MATH_SCHEMA)
        self.assertEqual(list(value), ["steps", "final_answer"])  # the schema's order

    def test_json_schema_calendar_event_n2_sampled(self):
        r = self.chat("Alice and Bob are going to a science fair on Friday. Extract the event.", n=2,
                      temperature=0.8, seed=11, response_format={
                          "type": "json_schema",
                          "json_schema": {"name": "calendar_event", "schema": EVENT_SCHEMA, "strict": True}})
        self.assertEqual(len(r.choices), 2)
        for choice in r.choices:
            self.assertEqual(choice.finish_reason, "stop", choice.message.content)
            validate(json.loads(choice.message.content), EVENT_SCHEMA)

    def test_json_schema_pattern_and_integer_bounds(self):
        # What pydantic sends for Field(pattern=r"^[A-Z]{2}-\d{3}$"), Field(ge=1, le=12) and a date field.
        schema = {"type": "object", "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
            "month": {"type": "integer", "minimum": 1, "maximum": 12},
            "note": {"type": "string", "pattern": "^[^\\n]{0,30}$"},
            "shipped": {"type": "string", "format": "date"}},
            "required": ["code", "month", "note", "shipped"], "additionalProperties": False}
        for temperature in (0, 1.0):
            r = self.chat("Invent a product code, a month number and a short note, as JSON.", temperature=temperature,
                          seed=7, response_format={"type": "json_schema",
                                                   "json_schema": {"name": "item", "schema": schema, "strict": True}})
            self.assertEqual(r.choices[0].finish_reason, "stop", r.choices[0].message.content)
            validate(json.loads(r.choices[0].message.content), schema)
        # vLLM's guided_regex: the whole text matches.
        r = self.c.completions.create(model="smol", prompt="The date today is", max_tokens=20, temperature=0,
                                      extra_body={"guided_regex": " (19|20)\\d{2}-(0[1-9]|1[0-2])-[0-3]\\d"})
        self.assertRegex(r.choices[0].text, r"^ (19|20)\d{2}-(0[1-9]|1[0-2])-[0-3]\d$")

    def test_gbnf_grammar_via_extra_body(self):
        grammar = 'root ::= answer "." \nanswer ::= ("yes" | "no") (", " [a-z]{1,8}){0,2}  # llama.cpp syntax\n'
        for temperature in (0, 1.0):
            r = self.chat("Is the sky blue?", extra_body={"grammar": grammar}, temperature=temperature, seed=5)
            self.assertRegex(r.choices[0].message.content, r"^(yes|no)(, [a-z]{1,8}){0,2}\.$")
            self.assertEqual(r.choices[0].finish_reason, "stop")
        # vLLM's names on /v1/completions.
        r = self.c.completions.create(model="smol", prompt="The capital of France is", max_tokens=20,
                                      temperature=0, extra_body={"guided_grammar": 'root ::= " " [A-Z] [a-z]+'})
        self.assertRegex(r.choices[0].text, r"^ [A-Z][a-z]+$")
        r = self.c.completions.create(model="smol", prompt="Pick one:", max_tokens=10, temperature=0,
                                      extra_body={"guided_choice": ["red", "green"]})
        self.assertIn(r.choices[0].text, ("red", "green"))
        r = self.c.completions.create(model="smol", prompt="A number:", max_tokens=10, temperature=0,
                                      extra_body={"guided_json": {"type": "integer"}})
        self.assertIsInstance(json.loads(r.choices[0].text), int)

    def test_streaming_with_schema(self):
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                   "population": {"type": "integer"}},
                  "required": ["city", "population"], "additionalProperties": False}
        chunks = list(self.chat("Give the largest city of Japan and its population.", stream=True,
                                response_format={"type": "json_schema",
                                                 "json_schema": {"name": "city", "schema": schema}}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        self.assertGreater(len(chunks), 3)
        self.assertEqual([ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason],
                         ["stop"])
        validate(json.loads(text), schema)

    def test_max_tokens_cuts_structured_output(self):
        r = self.chat("Write a long story as JSON.", max_tokens=5, response_format={"type": "json_object"})
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertTrue(r.choices[0].message.content.startswith("{"))

    def test_bad_schema_or_grammar_is_400_and_server_keeps_serving(self):
        bad = [
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
             "response_format", "unknown type"),
            ({"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"$ref": "#/$defs/nowhere"}}}}, "response_format", "does not resolve"),
            ({"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "string", "pattern": "^(?=a)b$"}}}}, "response_format", "lookahead"),
            ({"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "number", "minimum": 0}}}}, "response_format", "'minimum'"),
            ({"guided_regex": "(ab"}, "guided_regex", "unclosed '('"),
            ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
            ({"grammar": 'root ::= "a" | b'}, "grammar", "undefined rule 'b'"),
            ({"grammar": 'root ::= "a\nx ::= "b"'}, "grammar", "line 1, column 12"),
            ({"grammar": 'expr ::= "1"'}, "grammar", "no 'root' rule"),
            ({"grammar": 'root ::= root "a" | "a"'}, "grammar", "left recursion"),
            ({"grammar": 'root ::= [a-z' + "x" * 200000}, "grammar", "at most"),
            ({"guided_grammar": 'root ::= ("a"?)*'}, "guided_grammar", "left recursion"),
            # 2^30 parses open before the first byte: refused at once, not expanded (docs/serving.md).
            ({"grammar": "root ::= a0\n" + "".join(f'a{i} ::= a{i + 1} "x" | a{i + 1} "y"\n' for i in range(30))
              + 'a30 ::= "z"'}, "grammar", "too ambiguous to enforce"),
        ]
        for body, param, words in bad:
            with self.subTest(body=str(body)[:80]):
                with self.assertRaises(openai.BadRequestError) as cm:
                    self.chat("hi", max_tokens=5, extra_body=body)
                self.assertEqual(cm.exception.status_code, 400)
                err = cm.exception.body
                self.assertEqual(err["param"], param)
                self.assertEqual(err["type"], "invalid_request_error")
                self.assertIn(words, err["message"])
        r = self.chat("Say hi.", max_tokens=5)
        self.assertTrue(r.choices[0].message.content)
        status, _ = SERVER.raw("GET", "/health", key=None)
        self.assertEqual(status, 200)


def main():
    global ARGS, SERVER
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom", required=True)
    ap.add_argument("--model", required=True)
    ARGS, rest = ap.parse_known_args()
    if openai is None:
        print("SKIP: the `openai` package is not installed (scripts/test installs it into build/test-venv)")
        return 77
    if not os.path.exists(ARGS.model):
        print(f"SKIP: {ARGS.model} is missing (run scripts/fetch_model)")
        return 77
    with tempfile.TemporaryDirectory() as root:
        SERVER = Server(ARGS.loom, ARGS.model, root)
        try:
            prog = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
            ok = prog.result.wasSuccessful()
        finally:
            SERVER.proc.send_signal(signal.SIGTERM)
            try:
                rc = SERVER.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                SERVER.proc.kill()
                rc = -1
            print(f"loom serve exited with {rc} after SIGTERM")
            with open(SERVER.log.name) as f:
                lines = f.read().splitlines()
            print(f"request log: {len(lines)} JSON lines")
            ok = ok and rc == 0 and all(json.loads(l) for l in lines if l.startswith("{"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
