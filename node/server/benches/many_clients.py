"""Concurrent-clients decode throughput of one pd-node build (BENCHMARKS.md, "Decode throughput";
history: docs/bench-log/llama-cpp.md, "Batched decode on the Q4_1 kernel"). Starts the node on the
real model, then three rounds of CLIENTS concurrent /v1/completions requests of 64 tokens (32-word
prompts, greedy, EOS ignored); prints tokens / wall time per round.

Usage: python3 node/server/benches/many_clients.py PD_NODE_BINARY PORT CLIENTS
(the model: the newest ~/.cache/pd-serve/models/*/*.gguf, from bash scripts/fetch-model.sh)."""
import json, sys, time, urllib.request, subprocess, random, concurrent.futures as cf
bin_, port, clients = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
M = subprocess.check_output("ls ~/.cache/pd-serve/models/*/*.gguf", shell=True, text=True).strip()
p = subprocess.Popen([bin_, "serve", "--model", M, "--port", str(port), "--num-gpu-blocks", "4096"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
url = f"http://127.0.0.1:{port}/v1/completions"
for _ in range(100):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health"); break
    except Exception: time.sleep(0.3)
words = "river mountain city history music science garden ocean train bridge winter summer".split()
def one(i, salt):
    random.seed(i * 1000 + salt)
    text = " ".join(random.choice(words) for _ in range(32))
    body = json.dumps({"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": text, "max_tokens": 64, "temperature": 0, "ignore_eos": True}).encode()
    r = urllib.request.urlopen(urllib.request.Request(url, data=body, headers={"content-type": "application/json"}))
    return json.loads(r.read())["usage"]["completion_tokens"]
rates = []
for rep in range(3):
    t = time.time()
    with cf.ThreadPoolExecutor(clients) as ex:
        toks = sum(ex.map(lambda i: one(i, rep), range(clients)))
    rates.append(toks / (time.time() - t))
p.kill()
print(bin_, clients, "clients:", " ".join("%.1f" % r for r in rates), "tok/s")
