// The doctest runner for every suite in tests/.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <string>

// ctest runs each case by its name (doctest_discover_tests), and CMake reads a ';' in a name as a list
// separator: such a case would be registered under its name's first part, match no case and pass
// having run nothing.
TEST_CASE("tests: no test case name holds a semicolon, which ctest would split, running nothing") {
  for (const doctest::detail::TestCase& tc : doctest::detail::getRegisteredTests())
    CHECK_MESSAGE(std::string(tc.m_name).find(';') == std::string::npos,
                  (std::string(tc.m_file.c_str()) + ":" + std::to_string(tc.m_line) + ": " + tc.m_name));
}
