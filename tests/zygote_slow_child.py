"""A stand-in for the server in tests/test_zygote.py whose import takes seconds, as vLLM's does
(`ZYGOTE_TEST_IMPORT_S`, 3 by default)."""

import os
import time

time.sleep(float(os.environ.get("ZYGOTE_TEST_IMPORT_S", "3")))
if __name__ == "__main__":
    print("forked", flush=True)
    time.sleep(120)
