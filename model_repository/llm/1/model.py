"""llm: the exported decoder on its configured runtime (python_backend/runtime/factory.py), driven by the engine's
loop (continuous, dynamic or static batching).

Decoupled: each request gets one response per step with its new token ids, the last one flagged final. A request
with ``cancel: true`` and a ``request_key`` cancels the running request with that key. The front model, whose
clients' cancellations Triton does not pass on, sends such keys over a local socket instead
(python_backend/serving/cancel_channel.py)."""

import faulthandler
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backend.engine.loop import Engine
from python_backend.engine.scheduler import SchedulerConfig
from python_backend.engine.speculative import Drafter
from python_backend.errors import InvalidRequestError, tagged_message
from python_backend.guided.compiler import GuideCompiler
from python_backend.model_files import ModelSettings, resolve_model_dir
from python_backend.runtime.decoder import ServingLimits
from python_backend.runtime.factory import RuntimeSettings, open_decoder, open_draft_decoder
from python_backend.runtime.fault_injection import maybe_faulty
from python_backend.runtime.onnx_decoder import share_thread_pool
from python_backend.serving.cancel_channel import CancelListener
from python_backend.serving.heartbeat import Heartbeat
from python_backend.serving.llm_adapters import LoraSettings, adapter_for, adapter_request, apply_control, open_store
from python_backend.serving.llm_requests import LlmLimits, guide_from_inputs, prompt_score_arrays, sequence_from_inputs
from python_backend.serving.llm_speculation import SpeculationSettings
from python_backend.serving.request_inputs import scalar
from python_backend.serving.triton_glue import error_response, getter, model_config, parameters
from python_backend.serving.triton_metrics import TritonMetricsObserver

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        faulthandler.enable(all_threads=True)  # a crashing stub leaves its threads' Python stacks in the server's log
        params = parameters(args)
        model_dir = resolve_model_dir(params["model_dir"], args["model_repository"])
        self.settings = ModelSettings.load(model_dir)
        max_batch_size = int(model_config(args)["max_batch_size"])
        max_context_length = min(int(params["max_context_length"]), self.settings.max_position_embeddings)
        # KIND_GPU instances get their device from Triton; KIND_CPU ones use device 0 if their runtime wants a GPU.
        device_id = int(args.get("model_instance_device_id") or 0) if args.get("model_instance_kind") == "GPU" else 0
        self.lora = LoraSettings.from_parameters(params)
        self.project_root = project_root = Path(args["model_repository"]).resolve().parent.parent
        runtime = replace(RuntimeSettings.from_parameters(params, device_id), adapters=self.lora.enabled)
        serving_limits = ServingLimits(max_batch_size, int(params["max_prefill_tokens"]), max_context_length)
        speculation = SpeculationSettings.from_parameters(params)
        draft_dir = speculation.draft_dir(model_dir, self.settings, project_root)
        if draft_dir is not None and not runtime.uses_gpu:  # before any session: the draft and the model take turns
            share_thread_pool(runtime.intra_op_threads)
        decoder = open_decoder(runtime, model_dir, serving_limits, project_root=project_root)
        print(f"[llm] {args['model_instance_name']}: {type(decoder).__name__}, KV cache on {decoder.tensors.device}",
              file=sys.stderr, flush=True)
        drafter = None
        if draft_dir is not None and not decoder.scores_prompts:
            print(f"[llm] speculative decoding off: {model_dir}'s graph gives the last position's logits only (build "
                  "the variant again: make model QUANT=...)", file=sys.stderr, flush=True)
        elif draft_dir is not None:
            drafter = Drafter(open_draft_decoder(runtime, draft_dir, serving_limits, project_root),
                              speculation.draft_tokens, max_context_length)
            print(f"[llm] speculative decoding: a row decoding alone checks {speculation.draft_tokens} tokens of "
                  f"{draft_dir} a step", file=sys.stderr, flush=True)
        decoder = maybe_faulty(decoder)
        self.limits = LlmLimits(
            vocab_size=decoder.vocab_size,
            max_context_length=max_context_length,
            max_stop_sequences=int(params["max_stop_sequences"]),
            max_stop_sequence_tokens=int(params["max_stop_sequence_tokens"]),
            max_guide_bytes=int(params.get("max_guide_bytes") or 65536),
        )
        self.adapters = open_store(self.lora, model_dir, project_root)
        lora_bytes = self.lora.reserved_bytes(self.adapters.base) if self.adapters else 0
        if self.adapters:
            print(f"[llm] LoRA: up to {self.lora.max_loras} adapters resident and in a step, rank <= "
                  f"{self.lora.max_rank}: {lora_bytes / 2**20:.0f} MiB of "
                  f"kv_cache_budget_mb kept for them; named: {', '.join(self.lora.modules) or 'none'}",
                  file=sys.stderr, flush=True)
        self.guides = GuideCompiler.for_model(model_dir, self.settings.eos_token_ids, decoder.vocab_size,
                                              cache_size=int(params.get("guide_cache_size") or 256))
        config = SchedulerConfig.from_parameters(params, max_batch_size, decoder.cache_shape.bytes_per_token(),
                                                 getattr(decoder, "kv_layout", "padded"), max_context_length,
                                                 reserved_bytes=lora_bytes,
                                                 max_adapters_per_step=self.lora.max_loras)
        if params.get("enable_kv_cache_reuse", "").strip().lower() == "true" and not config.enable_kv_cache_reuse:
            print(f"[llm] enable_kv_cache_reuse: no prefix caching on {model_dir}, the export's graph (its KV cache "
                  "is a padded batch); every QUANT variant's folder (the fused graph) has it", file=sys.stderr,
                  flush=True)
        observer = TritonMetricsObserver(pb_utils, {"model": args["model_name"], "strategy": config.strategy,
                                                    "variant": self.settings.quantization})
        observer.set_limits(config.max_queue_size, config.kv_budget_tokens * decoder.cache_shape.bytes_per_token())
        self.engine = Engine(decoder, config, observer, outbox_capacity=int(params["outbox_capacity"]), drafter=drafter)
        self.engine.start()
        self.heartbeat = Heartbeat(args["model_instance_name"], self.engine.health)
        self.heartbeat.start()
        self.cancels = CancelListener(args["model_instance_name"], self.engine.cancel)  # the front model's
        self.cancels.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            get = getter(pb_utils, request)
            key = None
            try:
                key = scalar(get, "request_key")
                if scalar(get, "cancel", False):
                    if key is None:
                        raise InvalidRequestError("cancel needs a request_key")
                    self.engine.cancel(key)
                    _send(sender, _outputs([], True), FINAL)
                    continue
                lora = adapter_request(get)
                if lora.is_control:  # a load or an unload: answered once it is done
                    apply_control(lora, self.adapters, self.project_root)
                    _send(sender, _outputs([], True), FINAL)
                    continue
                seq = sequence_from_inputs(get, self.settings.eos_token_ids, self.limits)
                seq.adapter = adapter_for(lora, self.adapters)
                guide = guide_from_inputs(get, self.limits)
                if key is not None:
                    seq.key = key
                seq.emit = _emitter(sender, self.engine)
                seq.on_error = _error_sender(sender, for_front=key is not None)
                # A direct client's cancel is polled at every step; a keyed request comes from the front model
                # over BLS, which never sees a cancel (the front sends its key to the cancel socket instead).
                seq.is_cancelled = sender.is_cancelled if key is None else None
                if guide is None:
                    self.engine.submit(seq)
                else:  # compiled on the compiler's thread (at once when cached); the engine never waits for it
                    self.guides.submit(guide).add_done_callback(_guided_submitter(seq, self.engine))
            except Exception as error:
                _error_sender(sender, for_front=key is not None)(None, error)
        return None

    def finalize(self):
        self.cancels.stop()
        self.guides.close()
        self.heartbeat.stop()
        self.engine.stop()
        # The stub then segfaults on its way out, in the metric families' destructor (python_backend#429, fixed after
        # Triton 2.51): harmless once the model is unloaded. Destroying them here instead, while the stub runs, is
        # worse: on a reload, the new instance's families of the same names go with them and the server's heap is
        # corrupted (malloc() aborts in tritonserver, seen in make test).


def _guided_submitter(seq, engine):
    """Hands the sequence to the engine once its guide is compiled, or ends it with the guide's error."""

    def submit(compiled):
        try:
            seq.guide = compiled.result()
            engine.submit(seq)
        except Exception as error:
            seq.on_error(seq, error)

    return submit


def _send(sender, outputs, flags=0):
    """Sends these tensors, referenced until sent: Triton 2.51's stub drops the outputs its client did not ask for
    without the GIL, which frees their arrays if the response held their last reference (heap corruption;
    python_backend/serving/spent_streams.py tells the same bug's other path)."""
    sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=flags)


def _outputs(ids, finished):
    return [
        pb_utils.Tensor("output_ids", np.asarray([ids], np.int32).reshape(1, len(ids))),
        pb_utils.Tensor("finished", np.asarray([[finished]], np.bool_)),
    ]


def _token_outputs(seq, ids, finished, logprobs):
    outputs = _outputs(ids, finished)
    if finished:
        outputs.append(pb_utils.Tensor("finish_reason", np.array([[seq.finish_reason.encode()]], np.object_)))
    top = seq.params.top_logprobs
    if logprobs is not None:
        outputs.append(pb_utils.Tensor("output_log_probs",
                                       np.asarray([[lp.logprob for lp in logprobs]], np.float32).reshape(1, -1)))
        if top:
            shape = (1, len(logprobs), top)
            outputs += [
                pb_utils.Tensor("top_log_probs",
                                np.asarray([lp.top_logprobs for lp in logprobs], np.float32).reshape(shape)),
                pb_utils.Tensor("top_log_prob_ids",
                                np.asarray([lp.top_ids for lp in logprobs], np.int32).reshape(shape)),
            ]
    prompt = seq.take_prompt_logprobs()
    if prompt is not None:
        outputs += [pb_utils.Tensor(name, value[None]) for name, value in prompt_score_arrays(prompt, top).items()]
    return outputs


def _emitter(sender, engine):
    def emit(seq, new_ids, finished, logprobs):
        try:
            _send(sender, _token_outputs(seq, new_ids, finished, logprobs), FINAL if finished else 0)
        except Exception:
            if not finished:
                engine.cancel(seq.key)  # its client is gone: stop generating for nobody
            raise

    return emit


def _error_sender(sender, for_front):
    """Keyed requests come from the front model over BLS, where Triton loses an error response that follows data
    responses (measured: the front waited forever) and drops error codes: for them the error travels as a final data
    response with an ``error`` output, its code tagged in the message. Direct clients get a real error response."""

    def send(_seq, error):
        if for_front:
            message = np.array([[tagged_message(error).encode("utf-8")]], np.object_)
            outputs = _outputs([], True) + [pb_utils.Tensor("error", message)]
            _send(sender, outputs, FINAL)
        else:
            sender.send(error_response(pb_utils, error), flags=FINAL)

    return send
