"""preprocessing: validate the request, tokenize the prompt (with the chat template unless told not to)."""

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backend.model_files import resolve_model_dir
from python_backend.preprocessing import Preprocessor
from python_backend.tokenization import PromptTokenizer
from python_backend.triton_glue import error_response, getter, parameters


class TritonPythonModel:
    def initialize(self, args):
        params = parameters(args)
        model_dir = resolve_model_dir(params["model_dir"], args["model_repository"])
        self.preprocessor = Preprocessor(
            PromptTokenizer(model_dir), chat_template_by_default=params["apply_chat_template"].lower() == "true"
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                outputs = self.preprocessor.prepare(getter(pb_utils, request))
            except Exception as error:  # one bad request must not fail the others in its batch
                responses.append(error_response(pb_utils, error))
                continue
            tensors = [pb_utils.Tensor(name, np.expand_dims(value, 0)) for name, value in outputs.items()]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
