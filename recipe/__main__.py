from recipe.main import main

main()
