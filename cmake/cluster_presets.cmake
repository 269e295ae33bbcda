# Text files built in as raw strings, one {name, text} row each, for a generated .inc file (also
# used by the WebAssembly build in web/). moe_embed_texts(OUT "glob" ...) rewrites OUT only when
# its content changes and re-runs CMake when a file changes.
function(moe_embed_texts out)
  set(files)
  foreach(g ${ARGN})
    file(GLOB found CONFIGURE_DEPENDS ${g})
    list(APPEND files ${found})
  endforeach()
  set(body "")
  foreach(f ${files})
    get_filename_component(n ${f} NAME_WE)
    file(READ ${f} text)
    string(APPEND body "    {\"${n}\", R\"moecore(${text})moecore\"},\n")
  endforeach()
  file(WRITE ${out}.new "${body}")
  configure_file(${out}.new ${out} COPYONLY)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${files})
endfunction()

get_filename_component(MOE_ROOT ${CMAKE_CURRENT_LIST_DIR} DIRECTORY)
moe_embed_texts(${PROJECT_BINARY_DIR}/generated/plan/cluster_presets.inc ${MOE_ROOT}/configs/clusters/*.toml)
