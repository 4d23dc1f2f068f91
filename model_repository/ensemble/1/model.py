"""The user-facing model: validate and tokenize (python_backend/serving/preprocessing.py) → the llm model's token stream
(a BLS call) → incremental detokenization and stop strings → one answer, or a stream of text deltas.

`ensemble` is decoupled (gRPC streaming, /generate and /generate_stream); `ensemble_unary` runs this same file,
not decoupled, for HTTP /infer and gRPC ModelInfer. A client that goes away makes this model tell the llm model to
cancel its sequence (at its next token, or, over gRPC, within 0.1 s while it waits in the queue; Triton tells a model
nothing about a closed HTTP connection before its first response), over a local socket
(python_backend/serving/cancel_channel.py): Triton does not pass cancellation into composed models by itself. When
the llm model's process dies, the watchdog fails every request in flight at once
(python_backend/serving/front_requests.py). A finished BLS stream is released only after the stub has let go of it
(python_backend/serving/spent_streams.py: Triton 2.51's stub could otherwise free its tensors without the GIL)."""

import faulthandler
import secrets
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backend.errors import InvalidRequestError, UnavailableError, error_from_tagged
from python_backend.model_files import resolve_model_dir
from python_backend.serving.cancel_channel import CancelSender
from python_backend.serving.front_requests import InFlight, Reply, Watchdog, llm_unavailable
from python_backend.serving.frontend import CancellationWatch, LlmChunk, response_outputs, text_deltas
from python_backend.serving.heartbeat import Heartbeat, PeerLiveness
from python_backend.serving.periodic import Periodic
from python_backend.serving.preprocessing import Preprocessor
from python_backend.serving.request_inputs import scalar
from python_backend.serving.spent_streams import SpentStreams
from python_backend.serving.tokenization import PromptTokenizer
from python_backend.serving.triton_glue import error_response, model_config, parameters, request_parameters

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PROMPT_SCORES = ("prompt_log_probs", "prompt_top_log_probs", "prompt_top_log_prob_ids")


class TritonPythonModel:
    def initialize(self, args):
        faulthandler.enable(all_threads=True)  # a crashing stub leaves its threads' Python stacks in the server's log
        params = parameters(args)
        self.tokenizer = PromptTokenizer(resolve_model_dir(params["model_dir"], args["model_repository"]))
        self.preprocessor = Preprocessor(
            self.tokenizer,
            chat_template_by_default=params["apply_chat_template"].lower() == "true",
            max_prompt_bytes=int(params["max_prompt_bytes"]),
            max_stop_strings=int(params["max_stop_strings"]),
            max_stop_string_bytes=int(params["max_stop_string_bytes"]),
        )
        config = model_config(args)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.input_names = [tensor["name"] for tensor in config["input"]]  # passed on to preprocessing as they came
        self.in_flight = InFlight(int(params["max_concurrent_requests"]))
        self.cancel_sender = CancelSender("llm")
        self.cancellations = CancellationWatch(self.cancel_sender)
        self.cancellations.start()
        self.llm = PeerLiveness("llm")
        self.watchdog = Watchdog(self.llm.problem, self._fail_in_flight, busy=lambda: len(self.in_flight) > 0)
        self.watchdog.start()
        self.spent_streams = SpentStreams()
        self.stream_releaser = Periodic("spent-streams", 0.1,
                                        lambda: self.spent_streams.release(self.in_flight.cancellation_checks()))
        self.stream_releaser.start()
        self.heartbeat = Heartbeat(args["model_instance_name"])
        self.heartbeat.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            key = secrets.token_hex(16)
            tag = bool(request_parameters(request).get("tag_errors", False))
            try:
                inputs = {}
                for name in self.input_names:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        inputs[name] = tensor.as_numpy().copy()
                problem = self.llm.problem()
                if problem:
                    raise llm_unavailable(problem)
                reply = Reply(lambda response, final, sender=sender: sender.send(response, flags=FINAL if final else 0),
                              sender.is_cancelled, on_final=lambda key=key: self._forget(key),
                              error_response=lambda error, tag=tag: error_response(pb_utils, error, tag))
                self.in_flight.admit(key, reply)
            except Exception as error:
                sender.send(error_response(pb_utils, error, tag), flags=FINAL)
                continue
            threading.Thread(target=self._serve, args=(inputs, key, reply), name="front-request", daemon=True).start()
        return None

    def _forget(self, key):
        """Before a request's final response: afterwards its sender must not be asked anything."""
        self.cancellations.remove(key)
        self.in_flight.release(key)

    def _fail_in_flight(self, problem):
        failed = self.in_flight.fail_all(llm_unavailable(problem))
        if failed:
            print(f"[front] the llm model is not running ({problem}): failed {failed} requests in flight", flush=True)

    def _serve(self, inputs, key, reply):
        chunks = None
        try:
            stream = bool(scalar(inputs.get, "stream", False))
            if stream and not self.decoupled:
                raise InvalidRequestError("stream=true needs the decoupled model 'ensemble' "
                                          "(gRPC streaming or /generate_stream)")
            prepared = self.preprocessor.prepare(inputs.get)
            self.cancellations.add(key, reply.is_cancelled)
            chunks = _llm_stream([pb_utils.Tensor(n, np.expand_dims(v, 0)) for n, v in prepared.llm_inputs.items()],
                                 key, on_first=lambda: self.cancellations.started(key), spent=self.spent_streams)
            answered = sent_any = False
            for delta in text_deltas(chunks, self.tokenizer.decode, stream, reply.is_cancelled,
                                     lambda: self.cancellations.cancel(key), prepared.stop):
                outputs = [pb_utils.Tensor(name, value)
                           for name, value in response_outputs(delta, prepared, first=not sent_any).items()]
                reply.send(pb_utils.InferenceResponse(output_tensors=outputs), final=delta.finished)
                sent_any = True
                answered = answered or delta.finished  # text_deltas goes on draining the llm's stream
            if not answered:
                reply.send(None, final=True)  # cancelled: close the stream without more data
        except Exception as error:
            reply.fail(error)
        finally:
            if chunks is not None:
                chunks.close()  # text_deltas stops reading at the finished chunk: hand the spent stream over now

    def finalize(self):
        self.stream_releaser.stop()
        self.spent_streams.drop_all()
        self.heartbeat.stop()
        self.watchdog.stop()
        self.cancellations.stop()
        self.cancel_sender.close()
        self.in_flight.fail_all(UnavailableError("the model is shutting down"))


def _raise_for(response):
    if response.has_error():
        raise error_from_tagged(response.error().message())


def _llm_stream(tensors, key, on_first, spent):
    key_tensor = pb_utils.Tensor("request_key", np.array([[key.encode()]], np.object_))
    request = pb_utils.InferenceRequest(
        model_name="llm", inputs=tensors + [key_tensor],
        requested_output_names=["output_ids", "finished", "error", "finish_reason", "output_log_probs",
                                "top_log_probs", "top_log_prob_ids", *PROMPT_SCORES],
    )
    responses = request.exec(decoupled=True)
    try:
        yield from _llm_chunks(responses, on_first)
    finally:
        spent.hold(responses)


def _llm_chunks(responses, on_first):
    for response in responses:
        _raise_for(response)
        error = pb_utils.get_output_tensor_by_name(response, "error")
        if error is not None:
            message = error.as_numpy().reshape(-1)[0]
            raise error_from_tagged(message.decode("utf-8") if isinstance(message, bytes) else str(message))
        ids = pb_utils.get_output_tensor_by_name(response, "output_ids")
        if ids is None:  # an empty closing response
            continue
        finished = bool(pb_utils.get_output_tensor_by_name(response, "finished").as_numpy().reshape(-1)[0])
        if on_first is not None:
            on_first()
            on_first = None
        yield _llm_chunk(response, ids.as_numpy().reshape(-1).tolist(), finished)


def _llm_chunk(response, ids, finished):
    def output(name):
        tensor = pb_utils.get_output_tensor_by_name(response, name)
        return None if tensor is None else tensor.as_numpy()

    reason, logprobs, top, top_ids = (output(name) for name in
                                      ("finish_reason", "output_log_probs", "top_log_probs", "top_log_prob_ids"))
    scores = {name: output(name) for name in PROMPT_SCORES}
    scores = {name: value.reshape(value.shape[1:]) for name, value in scores.items() if value is not None}
    if reason is not None:
        reason = reason.reshape(-1)[0]
        reason = reason.decode() if isinstance(reason, bytes) else str(reason)
    return LlmChunk(
        ids, finished, reason,
        None if logprobs is None else logprobs.reshape(-1).tolist(),
        None if top is None or not ids else top.reshape(len(ids), -1).tolist(),
        None if top_ids is None or not ids else top_ids.reshape(len(ids), -1).tolist(),
        scores or None,
    )
