from tests.zoo._harness import TABLE, table_lines


def pytest_terminal_summary(terminalreporter):
    if TABLE:
        terminalreporter.section("model zoo")
        for line in table_lines():
            terminalreporter.write_line(line)
