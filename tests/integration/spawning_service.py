"""A stand-in service for the process tests: it starts a child that would outlive it (as
vLLM's engine processes do), writes the child's pid, then waits to be killed."""

import os
import subprocess
import sys
import time

if __name__ == "__main__":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["SPAWNER_PID_FILE"], "w") as f:
        f.write(str(child.pid))
    time.sleep(600)
