"""python -m recipe: the run (recipe.main), then an exit that skips the interpreter's teardown."""

from recipe.main import main
from recipe.procs import exit_without_teardown

try:
    main()
except SystemExit as e:
    exit_without_teardown(e.code)
exit_without_teardown(0)
