import sys

from fedjax_sparse.cli import main

sys.exit(main())
