import os

import torch

# numba.cuda must see the simulator switch before numba is first imported; a root
# tests/conftest.py may set it too (setdefault keeps whichever came first).
if not torch.cuda.is_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
