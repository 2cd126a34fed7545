import sys
from pathlib import Path

# Helper modules beside the tests (ckpt_cases, the gloo worker) import by plain name,
# including from subprocesses started by torch.multiprocessing.spawn.
sys.path.insert(0, str(Path(__file__).parent))
