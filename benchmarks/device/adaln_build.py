"""Build (or load) the fused AdaLN extension and say how long it took: ``gpu_check_adaln.sh``'s first step."""

import time

from lightning_adaptiveload.ops import adaln_build_error, load_adaln_extension

if __name__ == "__main__":
    t = time.time()
    print("build ok:", load_adaln_extension(), adaln_build_error(), f"{time.time() - t:.0f}s")
