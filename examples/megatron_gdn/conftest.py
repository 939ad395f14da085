# Nothing to declare: pytest-linattn loads through its pytest11 entry point once installed.
