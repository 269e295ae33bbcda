# Inlines the emscripten module (JS with the WebAssembly embedded) into the page at its marker.
file(READ ${PAGE} page)
file(READ ${JS} js)
string(FIND "${js}" "</script" bad)
if(NOT bad EQUAL -1)
  message(FATAL_ERROR "the module contains </script: it cannot be inlined as is")
endif()
string(REPLACE "/*MOECORE_PLANNER_MODULE*/" "${js}" page "${page}")
file(WRITE ${OUT} "${page}")
