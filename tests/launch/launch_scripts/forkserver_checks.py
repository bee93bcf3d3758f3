"""The fork server on its own, in a fresh process (forking the test process would copy
pytest's threads): exit codes as Popen gives them, waits with a timeout, and signalling
a worker that the server has already reaped. Prints "OK" when every check passed."""
import os
import signal
import subprocess
import sys

from globaltensor.launch import boot
from globaltensor.launch.forkserver import ForkServer, can_fork, handler_factory

WORK = sys.argv[1]


def script(name: str, text: str) -> str:
    path = os.path.join(WORK, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def main() -> None:
    assert can_fork() is None, can_fork()
    os.environ["GLOBALTENSOR_LAUNCHER_PID"] = str(os.getpid())
    server = ForkServer.start()
    started = []
    get_handler = handler_factory(server, lambda pid, env: started.append((pid, env["RANK"])))
    env = {**os.environ, "RANK": "0"}

    def run(path: str, *args: str):
        out = os.path.join(WORK, os.path.basename(path) + ".out")
        return get_handler(sys.executable, ("-u", boot.__file__, path, *args), env, out, out, 0)

    exits = run(script("exits.py", "import sys\nprint('bye')\nsys.exit(7)\n"))
    assert exits.proc.wait(30) == 7 and exits.proc.poll() == 7
    exits.close()  # reaped by the server already: no error
    assert open(os.path.join(WORK, "exits.py.out")).read() == "bye\n"

    says = run(script("says.py", "import sys\nsys.exit('a message')\n"))
    assert says.proc.wait(30) == 1
    says.close()
    assert "a message" in open(os.path.join(WORK, "says.py.out")).read()

    waits = run(script("waits.py", "import signal\nsignal.pause()\n"))
    assert waits.proc.poll() is None
    try:
        waits.proc.wait(0.2)
        raise AssertionError("a waiting worker ended")
    except subprocess.TimeoutExpired:
        pass
    waits.close(signal.SIGKILL)
    assert waits.proc.wait(30) == -signal.SIGKILL  # as Popen's returncode

    assert [rank for _, rank in started] == ["0", "0", "0"]
    assert all(pid != os.getpid() for pid, _ in started)
    server.close()
    try:
        os.waitpid(server.pid, os.WNOHANG)
        raise AssertionError("the closed server was not reaped")
    except ChildProcessError:
        pass
    try:
        ForkServer.spawn(server, ["-c", "print(1)"], env, None, None)
        raise AssertionError("the fork server ran a command other than the boot file")
    except ValueError as e:
        assert "only the launcher's boot file" in str(e)
    print("OK")


if __name__ == "__main__":
    main()
