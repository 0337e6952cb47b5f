from trtc.cli import main

main()
