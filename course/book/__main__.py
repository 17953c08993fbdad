from .appendix import main

main()
