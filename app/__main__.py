import sys

from app.rank.helper import HELPER_COMMAND

if sys.argv[1:2] == [HELPER_COMMAND]:
    # A rank's serving helper (started by the rank itself): none of the CLI's set-up, its own logging.
    from app.rank.helper import main as helper_main

    sys.exit(helper_main(sys.argv[2:]))

from app.cli import main

sys.exit(main())
