from attnserve.cli import main

raise SystemExit(main())
