"""Rollouts that overlap training: the engine in its own process, at most max_staleness policy versions behind.

    engine = RolloutProcess(rollout, seed, model_dir, dtype, max_len, device)   # starts it, loads the engine
    engine.sync_weights(model)              # version 0: the policy as GRPO starts
    engine.submit(step, prompt_ids, seed)   # returns at once; the process generates in the background
    generation, info = engine.take(step)    # waits for that step's rollout; info: version, seconds, idle
    engine.generate(prompt_ids, seed, n)    # blocking (evaluations), as the in-process engines
    engine.close()

The process serves its requests in the order they were sent: a weight push sent before a request is in the
engine before the request runs, so staleness is bounded by when requests are submitted
(grpo_fast.train.rollout.AheadRollouts does it). With max_staleness k it keeps
steps s .. s + k submitted while it trains step s, and submits step s + k + 1 right after pushing the weights of
version s + 1 (the policy after s + 1 optimizer steps): every rollout comes from a policy at most k versions old,
and none is generated only to be dropped. Each rollout carries the version it came from and the engine's log-prob
of every sampled token (the behaviour policy), which the loss's rollout correction weighs against the trainer's.

The engine is the HF one (`model.generate`, on a copy of the policy) or vLLM (an offline `vllm.LLM`, weights
pushed through its `reload_weights`). A process that dies, or an engine that fails, raises EngineError naming the
request; the loop names the step and saves nothing new. One that cannot start raises EngineStartError, a
ValueError too (the loop's setup errors are ValueErrors: one line at the command line).

The process dies with the trainer, whatever kills it: on Linux the kernel sends it SIGKILL when the trainer dies
(PR_SET_PDEATHSIG), and a thread that polls its parent's pid covers the other platforms and a trainer that started
it from a thread other than its main one (the kernel signal follows the starting thread, not the process, so it is
not set then). Requests and results go
through a pipe, not multiprocessing queues: queues are named semaphores in /dev/shm, which only multiprocessing's
resource tracker removes, so a SIGKILL of the whole process group left them behind; a pipe closes with its
processes. The process ignores SIGINT and SIGTERM: a Ctrl-C or `timeout` reaches the whole process group, and
the trainer, which saves first, stops this process itself.
"""

from __future__ import annotations

import ast
import ctypes
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Optional

import torch
import torch.multiprocessing as mp

from grpo_fast.train.lora import engine_weights
from grpo_fast.train.policy import from_pretrained
from grpo_fast.train.rollout.config import RolloutConfig
from grpo_fast.train.rollout.engines import HFEngine, VLLMEngine
from grpo_fast.train.rollout.generation import EngineError, EngineStartError
from grpo_fast.train.run import quiet

STOP, WEIGHTS, GENERATE = "stop", "weights", "generate"
START_TIMEOUT_S = 600        # loading an engine (vLLM compiles and profiles) may take minutes on CPU
POLL_S = 0.5                 # how often the trainer checks that the process lives, and the process its parent
ORPHANED = 70                # the process's exit code when it finds its parent gone
PR_SET_PDEATHSIG = 1         # <linux/prctl.h>


def split_threads(device: torch.device) -> tuple[int, int]:
    """(trainer threads, engine threads) on CPU: the cores this process may use, shared so that generation and
    the update do not compete for the same cores; (current, current) on a GPU."""
    threads = torch.get_num_threads()
    if device.type != "cpu":
        return threads, threads
    engine_threads = max(1, threads // 2)
    return max(1, threads - engine_threads), engine_threads


# ------------------------------------------------------------------------------------------- the process
def _die_with_parent(parent_pid: int, started_by_main_thread: bool) -> None:
    """Ends this process when `parent_pid` dies: the kernel's parent-death signal (Linux, when the parent started
    it from its main thread, which lives as long as the parent), and in every case a daemon thread that sees the
    process re-parented. Called first thing in the process; a parent already gone ends it here."""
    if sys.platform.startswith("linux") and started_by_main_thread:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass                                   # no prctl: the thread below still watches
    if os.getppid() != parent_pid:                 # the parent died before the signal was set
        os._exit(ORPHANED)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(POLL_S)
        os._exit(ORPHANED)

    threading.Thread(target=watch, name="grpo-fast-parent-watch", daemon=True).start()


def _build_engine(spec: dict):
    """The engine the process runs: HFEngine on the model folder, or VLLMEngine (it loads the folder itself)."""
    rollout, device = spec["rollout"], torch.device(spec["device"])
    if rollout.engine == "vllm":
        return VLLMEngine(spec["model_dir"], rollout, spec["seed"], spec["max_model_len"], device,
                          spec["rope_scaling"])
    from transformers import AutoTokenizer

    model = from_pretrained(spec["model_dir"], spec["dtype"], spec["rope_scaling"]).to(device)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return HFEngine(model.eval().requires_grad_(False), tokenizer, rollout, sampling_logps=True)


def serve(requests, results, spec: dict) -> None:
    """The rollout process: builds the engine, then answers requests in order until STOP or until the trainer's
    end of the pipe closes. Results are ("started",) (the process runs: the trainer's main module imported
    again), ("ready",), ("generation", request, version, Generation, seconds, idle_seconds) or ("error",
    request, text); idle_seconds is the time the engine waited for this request (for weights or for work).
    Results are plain pickles (their tensors are small): no file descriptors or sockets to pass."""
    _die_with_parent(spec["parent_pid"], spec["started_by_main_thread"])
    for signum in (signal.SIGINT, signal.SIGTERM):   # the trainer's: it saves, then stops this process
        signal.signal(signum, signal.SIG_IGN)

    def send(result) -> None:
        results.send_bytes(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))

    send(("started",))
    if spec["quiet"]:                                  # as the trainer's process prints (grpo-fast's command line)
        quiet.quiet_output()
    torch.set_num_threads(spec["threads"])
    request = "start"
    try:
        engine = _build_engine(spec)
        send(("ready",))
        version, idle_since = None, time.perf_counter()
        while True:
            try:
                message = requests.recv()
            except EOFError:                           # the trainer closed its end (or died): nothing to serve
                return
            kind, request = message[0], message[1]
            if kind == STOP:
                return
            if kind == WEIGHTS:
                engine.load_weights(message[2])
                version = request
                continue
            waited = time.perf_counter() - idle_since
            started = time.perf_counter()
            prompt_ids, seed, n, max_tokens = message[2:]
            generation = engine.generate(prompt_ids, seed=seed, n=n, max_tokens=max_tokens)
            idle_since = time.perf_counter()
            send(("generation", request, version, generation, idle_since - started, waited))
    except Exception as error:   # noqa: BLE001 -- sent whole to the trainer, which names the step
        detail = "".join(traceback.format_exception_only(type(error), error)).strip()
        try:
            send(("error", request, detail))
        except OSError:
            pass                                       # the trainer is gone


# ------------------------------------------------------------------------------------------- the trainer's side
def start_without_ctrl_c(process) -> None:
    """process.start() with SIGINT ignored while it runs. A spawned Python keeps an inherited SIG_IGN (it installs
    its KeyboardInterrupt handler only over the default), so a Ctrl-C that reaches the process group while the
    child imports torch and builds its engine (seconds, before `serve` ignores it itself) does not stop the child
    with a traceback of its own; the trainer saves, then stops it. The trainer's handler is back as soon as the
    child exists: only a Ctrl-C within start()'s own milliseconds goes unseen (press it again)."""
    if threading.current_thread() is not threading.main_thread():
        process.start()                                # no handlers to change outside the main thread
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        process.start()
    finally:
        signal.signal(signal.SIGINT, previous)


def _main_module_call_unguarded() -> Optional[str]:
    """The path of the main script when the running code was called from one of its top-level statements outside
    `if __name__ == "__main__":`, else None. A spawned process imports the main module again, so such a call
    would run again in the rollout process, which then dies before it starts."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or not os.path.isfile(path):
        return None                                    # interactive, -c: a spawned process imports nothing
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return None
    try:
        with open(path, encoding="utf-8") as source:
            statements = ast.parse(source.read()).body
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    while statements:                                  # down the compound statements holding the calling line
        holding = [s for s in statements if s.lineno <= line <= (s.end_lineno or s.lineno)]
        if not holding:
            return None
        statement = holding[0]
        if isinstance(statement, ast.If) and any(isinstance(node, ast.Name) and node.id == "__name__"
                                                 for node in ast.walk(statement.test)):
            return None
        statements = [s for field in ("body", "orelse", "finalbody", "handlers") for s in
                      getattr(statement, field, []) if isinstance(s, (ast.stmt, ast.excepthandler))]
    return path


def refuse_unguarded_main(max_staleness: int) -> None:
    """Raises EngineStartError, naming the script, when the training call would run again in the rollout process
    that max_staleness >= 1 spawns (see _main_module_call_unguarded): before anything is spawned or written."""
    script = _main_module_call_unguarded()
    if script is not None:
        raise EngineStartError(f"max_staleness={max_staleness} runs the engine in a spawned process, "
                               f"which imports {script} again and would run its training call again: put the "
                               f"call under `if __name__ == \"__main__\":` in {script}")


def _send_requests(connection, outbox: queue.Queue) -> None:
    """The trainer's sender thread: requests go out in order without the loop waiting for the pipe (a weight push
    is as large as the policy). Ends on None, or when the process's end is gone (the loop names the death)."""
    while True:
        message = outbox.get()
        if message is None:
            return
        try:
            connection.send(message)
        except (OSError, EOFError):
            return


class RolloutProcess:
    """An engine in a child process (spawned: its own CUDA context and RNG), used as the loop's engine.

    rollout: the rollout section (engine, sampling keys); seed: the run's (vLLM's); model_dir: a Hugging Face
    folder of the policy's architecture and tokenizer (weights are pushed after); dtype: the engine's weights (HF);
    max_model_len: prompt + completion tokens (vLLM); device: where the engine runs; policy_version: the version
    of the first weights pushed (the optimizer steps they have had: a resumed run's step); rope_scaling: the
    policy's (policy.rope_scaling), which the engine's copy applies as the trainer's model does.
    """

    def __init__(self, rollout: RolloutConfig, seed: int, model_dir: str, dtype: torch.dtype, max_model_len: int,
                 device: torch.device, policy_version: int = 0, rope_scaling: Optional[dict] = None):
        refuse_unguarded_main(rollout.max_staleness)
        self.name, self.device, self.model_dir = rollout.engine, device, model_dir
        self.trainer_threads, engine_threads = split_threads(device)
        self.restore_threads = torch.get_num_threads()
        context = mp.get_context("spawn")
        request_reader, request_writer = context.Pipe(duplex=False)
        result_reader, result_writer = context.Pipe(duplex=False)
        spec = {"rollout": rollout, "seed": seed, "model_dir": model_dir, "dtype": dtype, "rope_scaling": rope_scaling,
                "max_model_len": max_model_len, "device": str(device), "threads": engine_threads,
                "parent_pid": os.getpid(), "quiet": quiet.installed(),
                "started_by_main_thread": threading.current_thread() is threading.main_thread()}
        self.process = context.Process(target=serve, args=(request_reader, result_writer, spec), daemon=True,
                                       name="grpo-fast-rollouts")
        start_without_ctrl_c(self.process)
        request_reader.close()                 # the process's ends: a dead process then reads as end of file
        result_writer.close()
        self.results, self._request_pipe = result_reader, request_writer
        self.requests: queue.Queue = queue.Queue()      # (kind, request, ...) tuples, sent in order
        self._sender = threading.Thread(target=_send_requests, args=(request_writer, self.requests), daemon=True,
                                        name="grpo-fast-rollout-requests")
        self._sender.start()
        self.done: dict = {}              # request -> result, for results that arrive before they are asked for
        self.version = policy_version - 1   # the last version pushed: the first push is policy_version
        self.eval_requests = 0
        try:
            self._wait_for(lambda: "ready" in self.done, "start", START_TIMEOUT_S)
        except BaseException:                  # a failed start, or a Ctrl-C / SIGTERM while it loads
            self.close()
            raise
        torch.set_num_threads(self.trainer_threads)

    # ------------------------------------------------------------------------------------------- requests
    def sync_weights(self, model) -> None:
        """Push the policy's weights (Hugging Face names, LoRA merged) as the next version; returns at once."""
        self.version += 1
        self._check_alive(f"weights of version {self.version}")
        weights = {name: tensor.detach().to("cpu", copy=True) for name, tensor in engine_weights(model).items()}
        self.requests.put((WEIGHTS, self.version, weights))

    def submit(self, step: int, prompt_ids: list, seed: int, max_tokens: Optional[int] = None) -> None:
        """Ask for step `step`'s rollout (group_size completions per prompt) from the weights pushed last."""
        self._check_alive(step)
        self.requests.put((GENERATE, step, prompt_ids, seed, None, max_tokens))

    def take(self, step: int):
        """(Generation, info) of a submitted step, waiting for it: info has the policy version it was sampled
        from, the engine's generation seconds and its idle seconds before it."""
        _, _, version, generation, seconds, idle = self._wait_for(lambda: step in self.done, step).pop(step)
        return generation, {"policy_version": version, "engine_generation_seconds": seconds,
                            "engine_idle_seconds": idle}

    def generate(self, prompt_ids: list, seed: int, n: Optional[int] = None, max_tokens: Optional[int] = None):
        """As the in-process engines' generate: a blocking request, served after those sent before it."""
        self._check_alive("evaluation")
        self.eval_requests += 1
        request = f"eval-{self.eval_requests}"
        self.requests.put((GENERATE, request, prompt_ids, seed, n, max_tokens))
        return self._wait_for(lambda: request in self.done, request).pop(request)[3]

    # ------------------------------------------------------------------------------------------- plumbing
    def _wait_for(self, arrived, request, timeout: Optional[float] = None) -> dict:
        """Collects results until `arrived()`; raises EngineError on an engine error or a dead process
        (EngineStartError while the engine starts)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not arrived():
            try:
                result = pickle.loads(self.results.recv_bytes()) if self.results.poll(POLL_S) else None
            except (EOFError, OSError):                # the process's end closed: it is dying or dead
                self.process.join(timeout=5)
                result = None
            if result is None:
                self._check_alive(request)
                if deadline is not None and time.monotonic() > deadline:
                    self.close()
                    raise EngineStartError(f"the rollout process did not start its {self.name} engine "
                                           f"on {self.model_dir} within {timeout} s") from None
                continue
            if result[0] == "error":
                self.close()
                if result[1] == "start":
                    raise EngineStartError(f"the rollout process could not start its {self.name} "
                                           f"engine on {self.model_dir}: {result[2]}")
                raise EngineError(f"the {self.name} engine in the rollout process failed on request "
                                  f"{result[1]!r}: {result[2]}")
            self.done[result[1] if result[0] == "generation" else result[0]] = result
        return self.done

    def _check_alive(self, request) -> None:
        if self.process.is_alive():
            return
        code = self.process.exitcode
        started = "started" in self.done
        self.close()
        if not started and code is not None and code > 0:   # it died importing the trainer's main module
            raise EngineStartError(
                f"the rollout process exited with code {code} before it started: a spawned process imports the "
                f"trainer's main module ({getattr(sys.modules.get('__main__'), '__file__', None)}) again, so a "
                f"script must make its training call under `if __name__ == \"__main__\":` (its own error, if "
                f"any, is printed above)")
        error = EngineStartError if request == "start" else EngineError
        raise error(f"the rollout process ({self.name} engine) died with exit code {code} "
                    f"before answering request {request!r}")

    def close(self) -> None:
        """Stops the process (politely, then by signal) and gives the trainer its threads back. Idempotent."""
        if self.process.is_alive():
            self.requests.put((STOP, None))
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout=10)
        self.requests.put(None)
        self._sender.join(timeout=10)
        self._request_pipe.close()
        self.results.close()
        torch.set_num_threads(self.restore_threads)
