"""The user-facing model: validate and tokenize (python_backend/preprocessing.py) → the llm model's token stream
(a BLS call) → incremental detokenization → one answer, or a stream of text deltas.

`ensemble` is decoupled (gRPC streaming, /generate and /generate_stream); `ensemble_unary` runs this same file,
not decoupled, for HTTP /infer and gRPC ModelInfer. A client that goes away makes this model send the llm model a
cancel request for its sequence (at its next token, or within 0.1 s while it waits in the queue): Triton does not
pass cancellation into composed models by itself."""

import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backend.errors import InvalidRequestError, error_from_tagged
from python_backend.frontend import USER_INPUTS, CancellationWatch, text_deltas
from python_backend.model_files import resolve_model_dir
from python_backend.preprocessing import Preprocessor
from python_backend.request_inputs import scalar
from python_backend.tokenization import PromptTokenizer
from python_backend.triton_glue import error_response, model_config, parameters

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        params = parameters(args)
        self.tokenizer = PromptTokenizer(resolve_model_dir(params["model_dir"], args["model_repository"]))
        self.preprocessor = Preprocessor(self.tokenizer, params["apply_chat_template"].lower() == "true")
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(model_config(args))
        self.pool = ThreadPoolExecutor(int(params["max_concurrent_requests"]), thread_name_prefix="front")
        self.cancellations = CancellationWatch(_cancel)
        self.cancellations.start()

    def execute(self, requests):
        for request in requests:
            inputs = {}
            for name in USER_INPUTS + ("stream",):
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy().copy()
            self.pool.submit(self._serve, inputs, request.get_response_sender())
        return None

    def _serve(self, inputs, sender):
        key = uuid.uuid4().hex

        def send(response=None, final=False):
            if final:
                self.cancellations.remove(key)  # before the final response, after which the sender is gone
            sender.send(response, flags=FINAL if final else 0)

        try:
            stream = bool(scalar(inputs.get, "stream", False))
            if stream and not self.decoupled:
                raise InvalidRequestError("stream=true needs the decoupled model 'ensemble' "
                                          "(gRPC streaming or /generate_stream)")
            llm_inputs = self.preprocessor.prepare(inputs.get)
            self.cancellations.add(key, sender.is_cancelled)
            chunks = _llm_stream([pb_utils.Tensor(n, np.expand_dims(v, 0)) for n, v in llm_inputs.items()], key,
                                 on_first=lambda: self.cancellations.started(key))
            for delta in text_deltas(chunks, self.tokenizer.decode, stream, sender.is_cancelled,
                                     lambda: self.cancellations.cancel(key)):
                outputs = [pb_utils.Tensor("text_output", np.array([[delta.text.encode("utf-8")]], np.object_)),
                           pb_utils.Tensor("output_token_count", np.array([[delta.token_count]], np.int32))]
                send(pb_utils.InferenceResponse(output_tensors=outputs), final=delta.finished)
                if delta.finished:
                    return
            send(final=True)  # cancelled: close the stream without more data
        except Exception as error:
            send(error_response(pb_utils, error), final=True)

    def finalize(self):
        self.cancellations.stop()


def _raise_for(response):
    if response.has_error():
        raise error_from_tagged(response.error().message())


def _llm_stream(tensors, key, on_first):
    key_tensor = pb_utils.Tensor("request_key", np.array([[key.encode()]], np.object_))
    request = pb_utils.InferenceRequest(
        model_name="llm", inputs=tensors + [key_tensor], requested_output_names=["output_ids", "finished"]
    )
    for response in request.exec(decoupled=True):
        _raise_for(response)
        ids = pb_utils.get_output_tensor_by_name(response, "output_ids")
        if ids is None:  # an empty closing response
            continue
        finished = bool(pb_utils.get_output_tensor_by_name(response, "finished").as_numpy().reshape(-1)[0])
        if on_first is not None:
            on_first()
            on_first = None
        yield ids.as_numpy().reshape(-1).tolist(), finished


def _cancel(key):
    request = pb_utils.InferenceRequest(
        model_name="llm",
        inputs=[pb_utils.Tensor("request_key", np.array([[key.encode()]], np.object_)),
                pb_utils.Tensor("cancel", np.array([[True]], np.bool_))],
        requested_output_names=["finished"],
    )
    for response in request.exec(decoupled=True):
        _raise_for(response)
