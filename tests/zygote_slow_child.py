"""A stand-in for the server in tests/test_zygote.py whose import takes seconds, as vLLM's does."""

import time

time.sleep(3)
if __name__ == "__main__":
    print("forked", flush=True)
    time.sleep(120)
