"""`python bench/draft STEP ...`: the scenario (scenario.main); also each arm's training process."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a folder: the package's parent

from draft.scenario import main  # noqa: E402

sys.exit(main())
