"""`python -m scripts.run_batch`: the batch runner, scripts/clients/run_batch.py, under the name vLLM users expect."""

import sys

from scripts.clients.run_batch import main

if __name__ == "__main__":
    sys.exit(main())
