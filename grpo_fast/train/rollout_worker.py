"""Rollouts that overlap training: the engine in its own process, at most max_staleness policy versions behind.

    engine = RolloutProcess(config, model_dir, dtype, max_len, device)   # starts the process, loads the engine
    engine.sync_weights(model)              # version 0: the policy as GRPO starts
    engine.submit(step, prompt_ids, seed)   # returns at once; the process generates in the background
    generation, info = engine.take(step)    # waits for that step's rollout; info: version, seconds, idle
    engine.generate(prompt_ids, seed, n)    # blocking (evaluations), as the in-process engines
    engine.close()

The process serves its requests in the order they were sent: a weight push sent before a request is in the
engine before the request runs, so the loop bounds staleness by when it submits. With max_staleness k it keeps
steps s .. s + k submitted while it trains step s, and submits step s + k + 1 right after pushing the weights of
version s + 1 (the policy after s + 1 optimizer steps): every rollout comes from a policy at most k versions old,
and none is generated only to be dropped. Each rollout carries the version it came from and the engine's log-prob
of every sampled token (the behaviour policy), which the loss's rollout correction weighs against the trainer's.

The engine is the HF one (`model.generate`, on a copy of the policy) or vLLM (an offline `vllm.LLM`, weights
pushed through its `reload_weights`). A process that dies, or an engine that fails, raises EngineError naming the
request; the loop names the step and saves nothing new.
"""

from __future__ import annotations

import queue
import signal
import time
import traceback
from typing import Optional

import torch
import torch.multiprocessing as mp

from grpo_fast.train.lora import engine_weights

STOP, WEIGHTS, GENERATE = "stop", "weights", "generate"
START_TIMEOUT_S = 600        # loading an engine (vLLM compiles and profiles) may take minutes on CPU
POLL_S = 0.5


class EngineError(RuntimeError):
    """The rollout process failed: its engine's error, or the process died."""


def split_threads(device: torch.device) -> tuple[int, int]:
    """(trainer threads, engine threads) on CPU: the cores this process may use, shared so that generation and
    the update do not compete for the same cores; (current, current) on a GPU."""
    threads = torch.get_num_threads()
    if device.type != "cpu":
        return threads, threads
    engine_threads = max(1, threads // 2)
    return max(1, threads - engine_threads), engine_threads


def _build_engine(spec: dict):
    """The engine the process runs: HFEngine on the model folder, or VLLMEngine (it loads the folder itself)."""
    from grpo_fast.train.engines import HFEngine, VLLMEngine

    config, device = spec["config"], torch.device(spec["device"])
    if config.engine == "vllm":
        return VLLMEngine(spec["model_dir"], config, spec["max_model_len"], device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=spec["dtype"]).to(device)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return HFEngine(model.eval().requires_grad_(False), tokenizer, config, sampling_logps=True)


def serve(requests, results, spec: dict) -> None:
    """The rollout process: builds the engine, then answers requests in order until STOP. Results are
    ("ready",), ("generation", request, version, Generation, seconds, idle_seconds) or ("error", request, text);
    idle_seconds is the time the engine waited for this request (for weights or for work)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is the trainer's: it saves, then stops this process
    torch.set_num_threads(spec["threads"])
    request = "start"
    try:
        engine = _build_engine(spec)
        results.put(("ready",))
        version, idle_since = None, time.perf_counter()
        while True:
            message = requests.get()
            kind, request = message[0], message[1]
            if kind == STOP:
                return
            if kind == WEIGHTS:
                engine.load_weights(message[2])
                version = request
                continue
            waited = time.perf_counter() - idle_since
            started = time.perf_counter()
            prompt_ids, seed, n = message[2:]
            generation = engine.generate(prompt_ids, seed=seed, n=n)
            idle_since = time.perf_counter()
            results.put(("generation", request, version, generation, idle_since - started, waited))
    except Exception as error:   # noqa: BLE001 -- sent whole to the trainer, which names the step
        detail = "".join(traceback.format_exception_only(type(error), error)).strip()
        results.put(("error", request, detail))


class RolloutProcess:
    """An engine in a child process (spawned: its own CUDA context and RNG), used as the loop's engine.

    config: the TrainConfig (engine, sampling keys); model_dir: a Hugging Face folder of the policy's
    architecture and tokenizer (weights are pushed after); dtype: the engine's weights (HF); max_model_len: prompt
    + completion tokens (vLLM); device: where the engine runs; policy_version: the version of the first weights
    pushed (the optimizer steps they have had: a resumed run's step).
    """

    def __init__(self, config, model_dir: str, dtype: torch.dtype, max_model_len: int, device: torch.device,
                 policy_version: int = 0):
        self.config, self.device = config, device
        self.trainer_threads, engine_threads = split_threads(device)
        self.restore_threads = torch.get_num_threads()
        context = mp.get_context("spawn")
        self.requests, self.results = context.Queue(), context.Queue()
        spec = {"config": config, "model_dir": model_dir, "dtype": dtype, "max_model_len": max_model_len,
                "device": str(device), "threads": engine_threads}
        self.process = context.Process(target=serve, args=(self.requests, self.results, spec), daemon=True,
                                       name="grpo-fast-rollouts")
        self.process.start()
        self.done: dict = {}              # request -> result, for results that arrive before they are asked for
        self.version = policy_version - 1   # the last version pushed: the first push is policy_version
        self.eval_requests = 0
        self._wait_for(lambda: "ready" in self.done, "start", START_TIMEOUT_S)
        torch.set_num_threads(self.trainer_threads)

    # ------------------------------------------------------------------------------------------- requests
    def sync_weights(self, model) -> None:
        """Push the policy's weights (Hugging Face names, LoRA merged) as the next version; returns at once."""
        self.version += 1
        self._check_alive(f"weights of version {self.version}")
        weights = {name: tensor.detach().to("cpu", copy=True) for name, tensor in engine_weights(model).items()}
        self.requests.put((WEIGHTS, self.version, weights))

    def submit(self, step: int, prompt_ids: list, seed: int) -> None:
        """Ask for step `step`'s rollout (group_size completions per prompt) from the weights pushed last."""
        self._check_alive(step)
        self.requests.put((GENERATE, step, prompt_ids, seed, None))

    def take(self, step: int):
        """(Generation, info) of a submitted step, waiting for it: info has the policy version it was sampled
        from, the engine's generation seconds and its idle seconds before it."""
        _, _, version, generation, seconds, idle = self._wait_for(lambda: step in self.done, step).pop(step)
        return generation, {"policy_version": version, "engine_generation_seconds": seconds,
                            "engine_idle_seconds": idle}

    def generate(self, prompt_ids: list, seed: int, n: Optional[int] = None):
        """As the in-process engines' generate: a blocking request, served after those sent before it."""
        self._check_alive("evaluation")
        self.eval_requests += 1
        request = f"eval-{self.eval_requests}"
        self.requests.put((GENERATE, request, prompt_ids, seed, n))
        return self._wait_for(lambda: request in self.done, request).pop(request)[3]

    # ------------------------------------------------------------------------------------------- plumbing
    def _wait_for(self, arrived, request, timeout: Optional[float] = None) -> dict:
        """Collects results until `arrived()`; raises EngineError on an engine error or a dead process."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not arrived():
            try:
                result = self.results.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive(request)
                if deadline is not None and time.monotonic() > deadline:
                    self.close()
                    raise EngineError(f"the rollout process did not start its {self.config.engine} engine within "
                                      f"{timeout} s") from None
                continue
            if result[0] == "error":
                self.close()
                raise EngineError(f"the {self.config.engine} engine in the rollout process failed on request "
                                  f"{result[1]!r}: {result[2]}")
            self.done[result[0] if result[0] == "ready" else result[1]] = result
        return self.done

    def _check_alive(self, request) -> None:
        if not self.process.is_alive():
            code = self.process.exitcode
            self.close()
            raise EngineError(f"the rollout process ({self.config.engine} engine) died with exit code {code} "
                              f"before answering request {request!r}")

    def close(self) -> None:
        """Stops the process (politely, then by signal) and gives the trainer its threads back. Idempotent."""
        if self.process.is_alive():
            try:
                self.requests.put((STOP, None))
            except (OSError, ValueError):
                pass
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout=10)
        torch.set_num_threads(self.restore_threads)

